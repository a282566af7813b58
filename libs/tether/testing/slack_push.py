"""The Slack stand-in's side of the Events API: where it delivers a person's message (the app's
Request URL and signing secret) and the delivery itself, signed as Slack signs it.

The signature is made by `slack-sdk`'s `SignatureVerifier.generate_signature` (v0, HMAC-SHA256
over `v0:{timestamp}:{body}`), with `X-Slack-Signature` and `X-Slack-Request-Timestamp`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from slack_sdk.signature import SignatureVerifier

from tether.testing.slack_events import SIGNATURE_HEADER, TIMESTAMP_HEADER, encode

PUSH_TIMEOUT_S = 10.0
"""Slack gives an app three seconds; the stand-in waits longer, so a slow machine still answers."""


@dataclass(frozen=True)
class WebhookTarget:
    """The app's Request URL and the signing secret Slack signs its deliveries with."""

    url: str
    signing_secret: str


@dataclass(frozen=True)
class Pushed:
    """How the app answered a delivery: its HTTP status and body (status 0: never reached)."""

    status: int
    text: str


def signed_headers(signing_secret: str, raw: bytes, timestamp: int | None = None) -> dict[str, str]:
    """The headers Slack adds to a delivery of `raw`, signed with slack-sdk's own generator."""
    stamp = str(int(time.time()) if timestamp is None else timestamp)
    signature = SignatureVerifier(signing_secret).generate_signature(timestamp=stamp, body=raw)
    assert signature is not None  # None only for a missing timestamp or body
    return {TIMESTAMP_HEADER: stamp, SIGNATURE_HEADER: signature}


async def push(target: WebhookTarget, body: dict[str, Any]) -> Pushed:
    """POST `body` (compact JSON, as Slack sends it) to the target, signed; never raises for the
    app's answer or its absence."""
    raw = encode(body)
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "Slackbot 1.0 (+https://api.slack.com/robots)",
        **signed_headers(target.signing_secret, raw),
    }
    timeout = aiohttp.ClientTimeout(total=PUSH_TIMEOUT_S)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(target.url, data=raw, headers=headers) as response,
        ):
            return Pushed(response.status, await response.text())
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Pushed(0, f"{type(exc).__name__}: {exc}")
