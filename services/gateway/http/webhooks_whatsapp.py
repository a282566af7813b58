"""The WhatsApp Cloud API at a connection's webhook URL: Meta's subscription check (GET with
hub.mode, hub.verify_token, hub.challenge) and its webhook POSTs, verified by
X-Hub-Signature-256 over the raw body with the app secret before the body is parsed. Each
person's text message in entry[].changes[].value.messages[] is read for admission; the status
callbacks in value.statuses[] are read for the orchestrator to record."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from services.gateway.http.webhook_messages import (
    InboundMessage,
    forged,
    identifier_field,
    json_object,
    not_shaped,
)
from tether.errors import InvalidArgument, PermissionDenied
from tether.ids import is_identifier

PROVIDER = "WhatsApp"
SIGNATURE_HEADER = "X-Hub-Signature-256"
_PREFIX = "sha256="
# Far above what Meta sends (a number), far below what a response should echo.
MAX_CHALLENGE_CHARS = 256
MAX_CALLBACK_DATA_CHARS = 512


def subscribe(query: Mapping[str, str], verify_token: str) -> str:
    """The challenge to echo when the query is Meta's subscription check with this
    connection's verify token (compared in constant time); 403 otherwise."""
    sent = query.get("hub.verify_token", "")
    same = hmac.compare_digest(sent.encode(errors="replace"), verify_token.encode())
    if query.get("hub.mode") != "subscribe" or not verify_token or not same:
        raise PermissionDenied(
            "not a subscription check with this connection's verify token",
            code="bad_verify_token",
        )
    challenge = query.get("hub.challenge", "")
    if not challenge or len(challenge) > MAX_CHALLENGE_CHARS or not challenge.isprintable():
        raise InvalidArgument(f"hub.challenge must be 1-{MAX_CHALLENGE_CHARS} printable characters")
    return challenge


def verify(raw: bytes, headers: Mapping[str, str], secrets: Sequence[str]) -> None:
    """Pass when any of `secrets` (the app secret, then the previous one in grace) signed `raw`;
    401 else. No maintained library verifies X-Hub-Signature-256 (Meta publishes none for
    Python), so it is these lines: HMAC-SHA256 of the raw body, compared in constant time."""
    sent = headers.get(SIGNATURE_HEADER, "")
    if not sent.startswith(_PREFIX) or not sent.isascii():
        raise forged(PROVIDER)
    digest = sent[len(_PREFIX) :].lower().encode()
    for secret in secrets:
        expected = hmac.new(secret.encode(), raw, hashlib.sha256).hexdigest().encode()
        if hmac.compare_digest(expected, digest):
            return
    raise forged(PROVIDER)


@dataclass(frozen=True)
class StatusReport:
    """One status callback: a message the business sent, what became of it."""

    provider_message_id: str
    status: str
    callback_data: str
    errors_json: str
    reported_at: datetime


@dataclass(frozen=True)
class Notification:
    """What one verified POST carries."""

    messages: list[InboundMessage]
    statuses: list[StatusReport]


def _list(value: Any, what: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise not_shaped(PROVIDER, f"{what} must be a list")
    return value


def _dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise not_shaped(PROVIDER, f"{what} must be an object")
    return value


def event_id_of(message_id: str) -> str:
    """A message id as an admission event id: itself when it is an identifier, else (a wamid
    ending in base64's '=') its SHA-256, so a redelivery still maps to the same event."""
    if is_identifier(message_id):
        return message_id
    return "wamid-sha256:" + hashlib.sha256(message_id.encode()).hexdigest()


def _message(raw: Any, where: str) -> InboundMessage | None:
    message = _dict(raw, where)
    if message.get("type") != "text":
        return None  # images, reactions, ...: nothing this connection answers yet
    text = _dict(message.get("text"), f"{where}.text").get("body")
    if not isinstance(text, str):
        raise not_shaped(PROVIDER, f"{where}.text.body must be a string")
    message_id = message.get("id")
    if (
        not isinstance(message_id, str)
        or not message_id
        or len(message_id) > 256
        or not all(" " < c < "\x7f" for c in message_id)
    ):
        raise not_shaped(PROVIDER, f"{where}.id must be the message's id")
    sender = identifier_field(PROVIDER, f"{where}.from", message.get("from"))
    if not text:
        return None
    return InboundMessage(
        event_id=event_id_of(message_id),
        thread_id=sender,
        sender_id=sender,
        text=text,
        address=sender,
        # Answered as the provider named it (a wamid is base64, often ending in '=').
        reply_to=message_id,
    )


def _status(raw: Any, where: str) -> StatusReport:
    status = _dict(raw, where)
    message_id = status.get("id")
    if (
        not isinstance(message_id, str)
        or not message_id
        or len(message_id) > 256
        or not all(" " < c < "\x7f" for c in message_id)
    ):
        raise not_shaped(PROVIDER, f"{where}.id must be the message's id")
    state = identifier_field(PROVIDER, f"{where}.status", status.get("status"))
    stamp = status.get("timestamp")
    if not (isinstance(stamp, str) and stamp.isascii() and stamp.isdigit() and len(stamp) <= 12):
        raise not_shaped(PROVIDER, f"{where}.timestamp must be Unix seconds")
    data = status.get("biz_opaque_callback_data", "")
    if not isinstance(data, str) or len(data) > MAX_CALLBACK_DATA_CHARS or "\x00" in data:
        raise not_shaped(PROVIDER, f"{where}.biz_opaque_callback_data must be a short string")
    errors = status.get("errors")
    errors_json = "" if errors is None else json.dumps(errors, separators=(",", ":"))
    if len(errors_json) > 16384 or "\\u0000" in errors_json:
        raise not_shaped(PROVIDER, f"{where}.errors is too large or holds a NUL")
    return StatusReport(
        provider_message_id=message_id,
        status=state,
        callback_data=data,
        errors_json=errors_json,
        reported_at=datetime.fromtimestamp(int(stamp), UTC),
    )


def parse(raw: bytes) -> Notification:
    """The messages and statuses of a verified body, or 400."""
    body = json_object(raw, PROVIDER)
    if body.get("object") != "whatsapp_business_account":
        raise not_shaped(PROVIDER, "object must be whatsapp_business_account")
    messages: list[InboundMessage] = []
    statuses: list[StatusReport] = []
    for e, entry in enumerate(_list(body.get("entry"), "entry")):
        changes = _dict(entry, f"entry[{e}]").get("changes")
        for c, change in enumerate(_list(changes, f"entry[{e}].changes")):
            where = f"entry[{e}].changes[{c}].value"
            value = _dict(_dict(change, where).get("value"), where)
            for m, raw_message in enumerate(_list(value.get("messages"), f"{where}.messages")):
                found = _message(raw_message, f"{where}.messages[{m}]")
                if found is not None:
                    messages.append(found)
            for s, raw_status in enumerate(_list(value.get("statuses"), f"{where}.statuses")):
                statuses.append(_status(raw_status, f"{where}.statuses[{s}]"))
    return Notification(messages, statuses)
