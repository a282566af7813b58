"""What Slack sends an app: Events API bodies, signed as Slack signs them, posted to a URL.

    body = message_event(channel="C1", user="U1", text="hi", ts="1700000000.000100")
    delivery = await deliver(url, body, signing_secret, retry_num=1, retry_reason="http_timeout")

The signature is written here with hmac/hashlib, independently of `slack-sdk`, so a test of the
runtime's verifier (slack-sdk's `SignatureVerifier`) checks it against a second implementation
of Slack's v0 scheme rather than against itself.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

__all__ = [
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "Delivery",
    "deliver",
    "encode",
    "message_event",
    "sign",
    "signature",
    "url_verification",
]

SIGNATURE_HEADER = "X-Slack-Signature"
TIMESTAMP_HEADER = "X-Slack-Request-Timestamp"
RETRY_NUM_HEADER = "X-Slack-Retry-Num"
RETRY_REASON_HEADER = "X-Slack-Retry-Reason"

DEFAULT_TEAM_ID = "T0TETHER01"
DEFAULT_APP_ID = "A0TETHER01"
# Deprecated by Slack in favour of signatures but still present in every body it sends.
LEGACY_VERIFICATION_TOKEN = "legacy-verification-token"


def signature(signing_secret: str, timestamp: int | str, body: bytes) -> str:
    """`v0=` + hex HMAC-SHA256 of `v0:{timestamp}:{body}` under the signing secret."""
    base = b"v0:" + str(timestamp).encode() + b":" + body
    digest = hmac.new(signing_secret.encode(), base, hashlib.sha256).hexdigest()
    return f"v0={digest}"


def sign(body: bytes, signing_secret: str, timestamp: int | None = None) -> dict[str, str]:
    """The two headers Slack adds to a request; `timestamp` defaults to now (Unix seconds)."""
    stamp = int(time.time()) if timestamp is None else timestamp
    return {
        TIMESTAMP_HEADER: str(stamp),
        SIGNATURE_HEADER: signature(signing_secret, stamp, body),
    }


def encode(body: dict[str, Any] | bytes) -> bytes:
    """A body as the bytes that are signed and sent (compact JSON, as Slack sends it)."""
    if isinstance(body, bytes):
        return body
    return json.dumps(body, separators=(",", ":")).encode()


def new_event_id() -> str:
    """An id in Slack's shape (`Ev` + 10 upper-case alphanumerics)."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    return "Ev" + "".join(secrets.choice(alphabet) for _ in range(10))


def message_event(
    *,
    channel: str,
    user: str,
    text: str,
    ts: str,
    thread_ts: str | None = None,
    event_id: str | None = None,
    team_id: str = DEFAULT_TEAM_ID,
    api_app_id: str = DEFAULT_APP_ID,
    subtype: str | None = None,
    bot_id: str | None = None,
    channel_type: str = "channel",
) -> dict[str, Any]:
    """An `event_callback` carrying a `message` event, as Slack delivers a user's message.

    `subtype` and `bot_id` build the messages an app must ignore (`bot_message`,
    `message_changed`, `channel_join`); `thread_ts` is absent for a top-level message.
    """
    event: dict[str, Any] = {
        "type": "message",
        "channel": channel,
        "user": user,
        "text": text,
        "ts": ts,
        "event_ts": ts,
        "channel_type": channel_type,
        "team": team_id,
    }
    if thread_ts is not None:
        event["thread_ts"] = thread_ts
    if subtype is not None:
        event["subtype"] = subtype
    if bot_id is not None:
        event["bot_id"] = bot_id
    return {
        "token": LEGACY_VERIFICATION_TOKEN,
        "team_id": team_id,
        "api_app_id": api_app_id,
        "event": event,
        "type": "event_callback",
        "event_id": event_id if event_id is not None else new_event_id(),
        "event_time": int(float(ts)),
        "authorizations": [
            {
                "team_id": team_id,
                "user_id": "U0TETHERBOT",
                "is_bot": True,
                "is_enterprise_install": False,
            }
        ],
        "is_ext_shared_channel": False,
    }


def url_verification(challenge: str | None = None) -> dict[str, Any]:
    """The body Slack sends when an app's Request URL is saved; the app echoes `challenge`."""
    return {
        "token": LEGACY_VERIFICATION_TOKEN,
        "challenge": challenge if challenge is not None else secrets.token_urlsafe(32),
        "type": "url_verification",
    }


@dataclass(frozen=True)
class Delivery:
    """What the app answered to one delivery."""

    status: int
    text: str
    headers: dict[str, str]

    def json(self) -> Any:
        """The answer's body parsed as JSON."""
        return json.loads(self.text)


async def deliver(
    url: str,
    body: dict[str, Any] | bytes,
    signing_secret: str,
    *,
    timestamp: int | None = None,
    retry_num: int | None = None,
    retry_reason: str | None = None,
    headers: dict[str, str] | None = None,
    session: aiohttp.ClientSession | None = None,
) -> Delivery:
    """POST a body to `url` signed as Slack signs it; `retry_num`/`retry_reason` mark a redelivery.

    `headers` are added last, so a test can overwrite the signature with a forged one.
    """
    raw = encode(body)
    sent = {
        "Content-Type": "application/json",
        "User-Agent": "Slackbot 1.0 (+https://api.slack.com/robots)",
    }
    sent.update(sign(raw, signing_secret, timestamp))
    if retry_num is not None:
        sent[RETRY_NUM_HEADER] = str(retry_num)
    if retry_reason is not None:
        sent[RETRY_REASON_HEADER] = retry_reason
    sent.update(headers or {})
    if session is not None:
        return await _post(session, url, raw, sent)
    async with aiohttp.ClientSession() as own:
        return await _post(own, url, raw, sent)


async def _post(
    session: aiohttp.ClientSession, url: str, raw: bytes, headers: dict[str, str]
) -> Delivery:
    async with session.post(url, data=raw, headers=headers) as response:
        return Delivery(response.status, await response.text(), dict(response.headers))
