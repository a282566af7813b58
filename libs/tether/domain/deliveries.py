"""A channel run's answer going out: the delivery record, its states, its id and its events.

A delivery is recorded BEFORE the provider is called, under the run's lease, and named by an id
derived from the tenant and the run, so every attempt of the run finds the same record. Its
states, and what each obliges the next attempt to do:

- `pending`: recorded, maybe sent. Neither Slack nor WhatsApp takes an idempotency key, so a
  later attempt first asks the provider for its own delivery (Slack's message metadata,
  WhatsApp's status callback) and posts only when it finds none; where the provider cannot
  answer the delivery ends `unknown` rather than risk a second post.
- `awaiting-approval`: drafted, waiting for a person (the run parked); allow-once moves it to
  `pending` and sends exactly the stored text, deny ends it `denied`.
- `sent`, `failed`, `unknown`, `denied`: the outcome, each reported by its `delivery.*` event
  before `run.completed`. The run's task outcome, separate from its runtime completion.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from tether.domain.events import Event, EventType
from tether.domain.outcomes import RunError

PENDING = "pending"
AWAITING_APPROVAL = "awaiting-approval"
SENT = "sent"
FAILED = "failed"
UNKNOWN = "unknown"
DENIED = "denied"
OUTCOMES = frozenset({SENT, FAILED, UNKNOWN, DENIED})
"""The states a delivery ends in."""
OPEN = (PENDING, AWAITING_APPROVAL)
"""The states a delivery may still move from."""
STATES = (*OPEN, *sorted(OUTCOMES))
_EVENTS = {
    SENT: EventType.DELIVERY_SENT,
    FAILED: EventType.DELIVERY_FAILED,
    UNKNOWN: EventType.DELIVERY_UNKNOWN,
    DENIED: EventType.DELIVERY_DENIED,
}
DELIVERY_PREFIX = "dlv_"
SEND_REPLY = "send_reply"
"""The risk category (and the name an approval shows) of an answer going out."""


def delivery_id(tenant_id: str, run_id: str, what: str = "answer") -> str:
    """The id of the run's delivery of `what`: the same for every attempt of the run, and what
    the provider carries back (Slack's metadata, WhatsApp's callback data, the webhook-id)."""
    digest = hashlib.sha256(f"{tenant_id}\x00{run_id}\x00{what}".encode()).hexdigest()
    return DELIVERY_PREFIX + digest[:32]


def may_move(current: str, new: str) -> bool:
    """Whether a delivery in `current` may move to `new`: from an open state only, and never
    back to awaiting approval."""
    if current not in OPEN or new not in STATES or new == AWAITING_APPROVAL:
        return False
    return not (current == AWAITING_APPROVAL and new in (SENT, UNKNOWN))


@dataclass(frozen=True, slots=True)
class Delivery:
    """A delivery as recorded."""

    delivery_id: str
    run_id: str
    channel_id: str
    kind: str
    state: str
    text: str
    provider_message_id: str = ""
    attempts: int = 0
    error: RunError | None = None
    created_at: datetime | None = None
    finished_at: datetime | None = None

    @property
    def finished(self) -> bool:
        """Whether it reached its outcome."""
        return self.state in OUTCOMES


def ended_with_run(delivery: Delivery, status: str) -> Delivery:
    """The outcome of a delivery still open when its run ended `status` without the worker
    finishing it (the reaper spent the attempts, a parked run was cancelled): `unknown` when a
    counted call may have landed (it is never sent again to find out), `failed` when none was
    made."""
    if delivery.attempts > 0:
        error = RunError(
            "delivery_unknown",
            f"the run ended {status} while its answer was going out; it may have been posted, "
            "and it was not sent again",
        )
        return replace(delivery, state=UNKNOWN, error=error)
    error = RunError("delivery_abandoned", f"the run ended {status} before its answer went out")
    return replace(delivery, state=FAILED, error=error)


def delivery_event(delivery: Delivery) -> Event:
    """The `delivery.<state>` event of a delivery that reached its outcome."""
    payload: dict[str, Any] = {
        "deliveryId": delivery.delivery_id,
        "channelId": delivery.channel_id,
        "kind": delivery.kind,
    }
    if delivery.provider_message_id:
        payload["providerMessageId"] = delivery.provider_message_id
    if delivery.error is not None:
        payload["error"] = delivery.error.to_json()
    return Event(_EVENTS[delivery.state], payload)
