"""What the gateway's webhook endpoints read out of a verified provider body: the messages to
admit (each with where its answer goes) and the refusals every provider shares."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tether.errors import InvalidArgument, Unauthenticated
from tether.ids import is_identifier


@dataclass(frozen=True)
class InboundMessage:
    """One person's message a verified webhook carried, ready for admission: the provider's
    event id (the idempotency key within the connection), its thread, sender and text, and the
    reply target's address, thread and message answered."""

    event_id: str
    thread_id: str
    sender_id: str
    text: str
    address: str
    thread: str = ""
    reply_to: str = ""


def forged(provider: str) -> Unauthenticated:
    """A signature that does not verify (or a timestamp outside the window): 401, nothing read."""
    return Unauthenticated(
        f"the request's {provider} signature does not verify against this connection's secret, "
        "or its timestamp is more than five minutes from now",
        code="bad_signature",
    )


def not_shaped(provider: str, why: str) -> InvalidArgument:
    """A verified body not in the provider's shape."""
    return InvalidArgument(f"not a {provider} webhook body: {why}", code="bad_webhook_body")


def json_object(raw: bytes, provider: str) -> dict[str, Any]:
    """The body as a JSON object, or 400."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise not_shaped(provider, "the body is not UTF-8") from exc
    except (ValueError, RecursionError) as exc:
        raise not_shaped(provider, f"the body is not JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise not_shaped(provider, f"the body is a JSON {type(data).__name__}, not an object")
    return data


def identifier_field(provider: str, what: str, value: Any) -> str:
    """A provider's id that becomes one of Tether's identifiers, or 400 naming it."""
    if not isinstance(value, str) or not is_identifier(value):
        raise not_shaped(
            provider,
            f"{what} must be 1-128 characters of letters, digits and . _ : @ - (starting with a "
            f"letter or digit); got {str(value)[:40]!r}",
        )
    return value
