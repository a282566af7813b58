"""Any system that signs its webhooks per Standard Webhooks (webhook-id, webhook-timestamp,
webhook-signature), at a `webhook` connection's URL: verified with the `standardwebhooks`
package against each valid secret (stored as the sender shows it, `whsec_` + base64; the
package signs with the decoded bytes), then the connection's JSON pointers (RFC 6901, resolved
with `jsonpointer`) pick the message's text, thread, sender and event id."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jsonpointer
from standardwebhooks import Webhook, WebhookVerificationError
from standardwebhooks.webhooks import EmptyWebhookSecretError

from services.gateway.http.webhook_messages import InboundMessage, forged, json_object
from tether.errors import InvalidArgument
from tether.ids import is_identifier

PROVIDER = "Standard Webhooks"
HEADERS = ("webhook-id", "webhook-timestamp", "webhook-signature")
_MISSING = object()
# The pointers each field comes from, by the connection's setting that names it.
_FIELDS = (
    ("text_field", "text"),
    ("thread_field", "thread"),
    ("sender_field", "sender"),
    ("event_id_field", "event id"),
)


def verify(raw: bytes, headers: Mapping[str, str], secrets: Sequence[str]) -> None:
    """Pass when any of `secrets` signed `raw` with these headers within five minutes (the
    package's window); 401 else."""
    sent = {name: headers.get(name, "") for name in HEADERS}
    for secret in secrets:
        try:
            Webhook(secret).verify(raw, sent, json_parse=False)
        except (WebhookVerificationError, EmptyWebhookSecretError, ValueError, TypeError):
            continue  # ValueError: a signature that is not base64, a body that is not UTF-8
        return
    raise forged(PROVIDER)


def _pick(body: Any, pointer: str, setting: str, what: str) -> str:
    try:
        value = jsonpointer.resolve_pointer(body, pointer, _MISSING)
    except jsonpointer.JsonPointerException:
        value = _MISSING
    if value is _MISSING:
        raise InvalidArgument(
            f"the body has nothing at {pointer} (the connection's {setting}, the {what})",
            code="bad_webhook_body",
        )
    if not isinstance(value, str):
        raise InvalidArgument(
            f"the body's {pointer} (the connection's {setting}, the {what}) is a JSON "
            f"{type(value).__name__}, not a string",
            code="bad_webhook_body",
        )
    return value


def message(raw: bytes, settings: Mapping[str, str]) -> InboundMessage:
    """The message the connection's pointers pick out of a verified body, or 400."""
    body = json_object(raw, PROVIDER)
    picked = {what: _pick(body, settings[setting], setting, what) for setting, what in _FIELDS}
    for setting, what in _FIELDS[1:]:
        if not is_identifier(picked[what]):
            raise InvalidArgument(
                f"the body's {settings[setting]} (the connection's {setting}, the {what}) must "
                "be 1-128 characters of letters, digits and . _ : @ - (starting with a letter "
                f"or digit); got {picked[what][:40]!r}",
                code="bad_webhook_body",
            )
    return InboundMessage(
        event_id=picked["event id"],
        thread_id=picked["thread"],
        sender_id=picked["sender"],
        text=picked["text"],
        address=picked["thread"],
        reply_to=picked["event id"],
    )
