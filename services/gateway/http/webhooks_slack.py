"""Slack's Events API at a connection's webhook URL: the request verified with slack-sdk's
SignatureVerifier (v0 HMAC-SHA256 over `v0:timestamp:body`, the timestamp within five minutes)
against each valid signing secret before the body is parsed; then the url_verification
challenge answered, or a person's message event read for admission. The bot's own messages,
edits, joins and every other event are answered 200 and stored nowhere."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from slack_sdk.signature import SignatureVerifier

from services.gateway.http.webhook_messages import (
    InboundMessage,
    forged,
    identifier_field,
    json_object,
    not_shaped,
)

PROVIDER = "Slack"
TIMESTAMP_HEADER = "X-Slack-Request-Timestamp"
SIGNATURE_HEADER = "X-Slack-Signature"


def verify(raw: bytes, headers: Mapping[str, str], secrets: Sequence[str]) -> None:
    """Pass when any of `secrets` (current, then previous in grace) signed `raw`; 401 else."""
    timestamp = headers.get(TIMESTAMP_HEADER, "")
    signature = headers.get(SIGNATURE_HEADER, "")
    # The verifier calls int() on the timestamp and compares str signatures: anything but ASCII
    # digits and an ASCII signature cannot be Slack's, and would raise inside it.
    if not (timestamp.isascii() and timestamp.isdigit() and signature.isascii() and signature):
        raise forged(PROVIDER)
    for secret in secrets:
        if SignatureVerifier(secret).is_valid(raw, timestamp, signature):
            return
    raise forged(PROVIDER)


def challenge(body: Mapping[str, Any]) -> str | None:
    """The url_verification challenge to echo, or None for any other body."""
    if body.get("type") != "url_verification":
        return None
    value = body.get("challenge")
    if not isinstance(value, str) or not value or len(value) > 512:
        raise not_shaped(PROVIDER, "url_verification needs a challenge string")
    return value


def parse(raw: bytes) -> dict[str, Any]:
    """The verified body as JSON, or 400."""
    body = json_object(raw, PROVIDER)
    if not isinstance(body.get("type"), str):
        raise not_shaped(PROVIDER, "no type (url_verification, event_callback, ...)")
    return body


def message(body: Mapping[str, Any]) -> InboundMessage | None:
    """The person's message an event_callback carries, or None for an event to ignore."""
    if body.get("type") != "event_callback":
        return None
    event = body.get("event")
    if not isinstance(event, dict):
        raise not_shaped(PROVIDER, "an event_callback without an event object")
    if event.get("type") != "message" or "subtype" in event or "bot_id" in event:
        return None  # another event, an edit, a join, the bot's own message
    text = event.get("text")
    if not isinstance(text, str):
        raise not_shaped(PROVIDER, "a message event without text")
    if not text:
        return None  # nothing to answer (a file or blocks alone)
    event_id = identifier_field(PROVIDER, "event_id", body.get("event_id"))
    channel = identifier_field(PROVIDER, "event.channel", event.get("channel"))
    user = identifier_field(PROVIDER, "event.user", event.get("user"))
    ts = identifier_field(PROVIDER, "event.ts", event.get("ts"))
    thread_ts = event.get("thread_ts")
    thread = ts if thread_ts is None else identifier_field(PROVIDER, "event.thread_ts", thread_ts)
    thread_id = identifier_field(PROVIDER, "the thread (channel:thread_ts)", f"{channel}:{thread}")
    return InboundMessage(
        event_id=event_id,
        thread_id=thread_id,
        sender_id=user,
        text=text,
        address=channel,
        thread=thread,
        reply_to=ts,
    )
