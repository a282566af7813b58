"""What the WhatsApp Cloud API sends an app: webhook bodies (a person's text message, a status
callback) signed as Meta signs them, the subscription handshake, and posting them to a URL.

    body = text_message(sender="15551234567", text="hi")
    delivery = await deliver(url, body, app_secret)
    answered = await handshake(url, verify_token="v", challenge="1158201444")

The signature is written here with hmac/hashlib, so a test of the runtime's verifier checks it
against a second implementation of `X-Hub-Signature-256` rather than against itself.
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

from tether.testing.whatsapp_wire import (
    DEFAULT_BUSINESS_ACCOUNT_ID,
    DEFAULT_DISPLAY_PHONE_NUMBER,
    DEFAULT_PHONE_NUMBER_ID,
)

__all__ = [
    "SIGNATURE_HEADER",
    "Delivery",
    "deliver",
    "encode",
    "handshake",
    "new_message_id",
    "sign",
    "signature",
    "status_update",
    "subscription_query",
    "text_message",
]

SIGNATURE_HEADER = "X-Hub-Signature-256"


def signature(app_secret: str, body: bytes) -> str:
    """`sha256=` + hex HMAC-SHA256 of the raw body under the app secret."""
    return "sha256=" + hmac.new(app_secret.encode(), body, hashlib.sha256).hexdigest()


def sign(body: bytes, app_secret: str) -> dict[str, str]:
    """The header Meta adds to every webhook POST."""
    return {SIGNATURE_HEADER: signature(app_secret, body)}


def encode(body: dict[str, Any] | bytes) -> bytes:
    """A body as the bytes that are signed and sent (compact JSON)."""
    if isinstance(body, bytes):
        return body
    return json.dumps(body, separators=(",", ":")).encode()


def new_message_id() -> str:
    """An id in the Cloud API's shape (`wamid.` + base64 text), unique per call."""
    return "wamid." + secrets.token_urlsafe(36)


def _envelope(value: dict[str, Any], business_account_id: str) -> dict[str, Any]:
    return {
        "object": "whatsapp_business_account",
        "entry": [{"id": business_account_id, "changes": [{"field": "messages", "value": value}]}],
    }


def _metadata(phone_number_id: str, display_phone_number: str) -> dict[str, str]:
    return {"display_phone_number": display_phone_number, "phone_number_id": phone_number_id}


def text_message(
    *,
    sender: str,
    text: str,
    message_id: str | None = None,
    name: str = "Test Sender",
    timestamp: int | None = None,
    phone_number_id: str = DEFAULT_PHONE_NUMBER_ID,
    display_phone_number: str = DEFAULT_DISPLAY_PHONE_NUMBER,
    business_account_id: str = DEFAULT_BUSINESS_ACCOUNT_ID,
) -> dict[str, Any]:
    """The `messages` webhook for a person's text message to the business number."""
    stamp = int(time.time()) if timestamp is None else timestamp
    value = {
        "messaging_product": "whatsapp",
        "metadata": _metadata(phone_number_id, display_phone_number),
        "contacts": [{"profile": {"name": name}, "wa_id": sender}],
        "messages": [
            {
                "from": sender,
                "id": message_id if message_id is not None else new_message_id(),
                "timestamp": str(stamp),
                "type": "text",
                "text": {"body": text},
            }
        ],
    }
    return _envelope(value, business_account_id)


def status_update(
    *,
    message_id: str,
    status: str,
    recipient_id: str,
    biz_opaque_callback_data: str | None = None,
    timestamp: int | None = None,
    phone_number_id: str = DEFAULT_PHONE_NUMBER_ID,
    display_phone_number: str = DEFAULT_DISPLAY_PHONE_NUMBER,
    business_account_id: str = DEFAULT_BUSINESS_ACCOUNT_ID,
) -> dict[str, Any]:
    """The `messages` webhook reporting a sent message's `status` (`sent`, `delivered`, ...)."""
    reported: dict[str, Any] = {
        "id": message_id,
        "status": status,
        "timestamp": str(int(time.time()) if timestamp is None else timestamp),
        "recipient_id": recipient_id,
    }
    if biz_opaque_callback_data is not None:
        reported["biz_opaque_callback_data"] = biz_opaque_callback_data
    value = {
        "messaging_product": "whatsapp",
        "metadata": _metadata(phone_number_id, display_phone_number),
        "statuses": [reported],
    }
    return _envelope(value, business_account_id)


def subscription_query(verify_token: str, challenge: str | None = None) -> dict[str, str]:
    """The query of the GET Meta sends when a webhook URL is saved; the app echoes
    `hub.challenge` as its plain-text body when `hub.verify_token` is its own."""
    return {
        "hub.mode": "subscribe",
        "hub.verify_token": verify_token,
        "hub.challenge": challenge if challenge is not None else str(secrets.randbelow(10**10)),
    }


@dataclass(frozen=True)
class Delivery:
    """What the app answered to one request."""

    status: int
    text: str
    headers: dict[str, str]

    def json(self) -> Any:
        """The answer's body parsed as JSON."""
        return json.loads(self.text)


async def deliver(
    url: str,
    body: dict[str, Any] | bytes,
    app_secret: str,
    *,
    headers: dict[str, str] | None = None,
    session: aiohttp.ClientSession | None = None,
) -> Delivery:
    """POST a body to `url` signed as Meta signs it.

    `headers` are added last, so a test can overwrite the signature with a forged one.
    """
    raw = encode(body)
    sent = {"Content-Type": "application/json", "User-Agent": "facebookexternalua"}
    sent.update(sign(raw, app_secret))
    sent.update(headers or {})
    if session is not None:
        return await _request(session, "POST", url, data=raw, headers=sent)
    async with aiohttp.ClientSession() as own:
        return await _request(own, "POST", url, data=raw, headers=sent)


async def handshake(
    url: str,
    verify_token: str,
    challenge: str | None = None,
    *,
    session: aiohttp.ClientSession | None = None,
) -> Delivery:
    """GET `url` with the subscription query, as Meta checks a webhook URL."""
    query = subscription_query(verify_token, challenge)
    if session is not None:
        return await _request(session, "GET", url, params=query)
    async with aiohttp.ClientSession() as own:
        return await _request(own, "GET", url, params=query)


async def _request(
    session: aiohttp.ClientSession, method: str, url: str, **options: Any
) -> Delivery:
    async with session.request(method, url, **options) as response:
        return Delivery(response.status, await response.text(), dict(response.headers))
