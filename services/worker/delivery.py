"""A channel run's answer going out, once: the run's last external write, under its lease.

When the model's final turn ends with an answer and the run came through a channel connection,
the attempt delivers it before it completes (`deliver`):

1. the transcript is made durable, then the delivery is recorded (`BeginDelivery`) with the text:
   pending, or awaiting approval when the agent's approvals gate the `send_reply` risk (then the
   run parks with the draft as the approval's stored input);
2. each provider call is counted in the record BEFORE it is made, so a later attempt knows one
   may have landed;
3. the outcome (sent, failed, unknown, denied) is recorded with its `delivery.*` event, and the
   run completes.

An attempt that finds its run's delivery already recorded (`resume`) does not call the model:
the answer was final. It carries the record on: an outcome stands; an approval is claimed (allow
sends exactly the stored text, deny ends it denied); a pending delivery that may have been sent is
looked for at the provider first (`senders`) and posted only when not found, and where the
provider cannot say, the delivery ends `unknown` rather than risk a second post.

Retries follow the run's retry policy (the agent's limits), honouring Retry-After; a refusal (a
4xx other than 429, Slack's `ok: false`) fails the delivery at once with the provider's words.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import NoReturn

from services.worker.checkpoints import CheckpointWriter
from services.worker.interactions import LeasedInteractions, Parked
from services.worker.orchestrator_client import Orchestrator
from services.worker.senders import (
    LookupFailed,
    Refused,
    Sender,
    StatusLookup,
    Transient,
    delivery_session,
    posting_before,
    sender_for,
)
from services.worker.transcript import Transcript
from tether.domain import (
    DEFAULT_BACKOFF_INITIAL_S,
    DEFAULT_BACKOFF_MAX_S,
    ApprovalMarker,
    Assignment,
    Delivery,
    ReplyTarget,
    Role,
    RunError,
)
from tether.domain.deliveries import (
    AWAITING_APPROVAL,
    DENIED,
    FAILED,
    PENDING,
    SEND_REPLY,
    SENT,
    UNKNOWN,
)
from tether.errors import NotFound, StaleLease
from tether.retry import RetryPolicy
from tether.states import RunStatus
from tether.targets import TargetPolicy

# A summary shows this much of the drafted answer; the approval's input holds all of it.
SUMMARY_CHARS = 200
# How long before its lease lapses a worker stops making a counted provider call: the call's
# trip to the provider, and the clocks of the worker and the database apart.
SEND_MARGIN = timedelta(seconds=0.5)


@dataclass(frozen=True)
class DeliverySettings:
    """The worker's delivery settings: the outbound-target policy and how long a WhatsApp
    delivery that may have been sent waits for its status callback before it is sent again."""

    policy: TargetPolicy
    reconcile_s: float = 30.0


def gates_replies(approvals: str) -> bool:
    """Whether an agent's approvals (JSON text, "" for none) gate its answers going out."""
    if not approvals:
        return False
    try:
        parsed = json.loads(approvals)
    except ValueError:
        return True  # fail closed: an unreadable policy gates
    if not isinstance(parsed, dict):
        return True
    return SEND_REPLY in (parsed.get("risks") or {}) or SEND_REPLY in (parsed.get("tools") or {})


class Deliverer:
    """Delivers one attempt's answer to the channel its run came from."""

    def __init__(
        self,
        assignment: Assignment,
        target: ReplyTarget,
        *,
        orchestrator: Orchestrator,
        interactions: LeasedInteractions | None,
        transcript: Transcript,
        checkpoints: CheckpointWriter,
        settings: DeliverySettings,
    ) -> None:
        self._lease = assignment.lease
        self._config = assignment.config
        self._target = target
        self._orchestrator = orchestrator
        self._interactions = interactions
        self._transcript = transcript
        self._checkpoints = checkpoints
        self._settings = settings
        limits = assignment.config.limits
        initial = limits.backoff_initial_seconds or DEFAULT_BACKOFF_INITIAL_S
        self._policy = RetryPolicy(
            max_attempts=max(limits.max_attempts or 3, 1),
            initial_delay=initial,
            max_delay=max(limits.backoff_max_seconds or DEFAULT_BACKOFF_MAX_S, initial),
        )

    async def resume(self) -> Delivery | None:
        """Carry on the delivery an earlier attempt recorded, to its outcome; None when the run
        has none (its answer is not drafted yet)."""
        found, _ = await self._orchestrator.begin_delivery(
            self._lease, self._target, "", find_only=True
        )
        if found is None:
            return None
        return await self._carry_on(found)

    async def abandon(self, why: str) -> None:
        """The attempt ends without finishing its delivery (a caller's cancel, a crash): an open
        delivery gets its outcome now, so none is left without one. `unknown` when a counted
        call may have landed (never sent again to find out), `failed` when none was made."""
        found, _ = await self._orchestrator.begin_delivery(
            self._lease, self._target, "", find_only=True
        )
        if found is None or found.finished:
            return
        if found.attempts > 0:
            await self._end(
                found,
                UNKNOWN,
                RunError(
                    "delivery_unknown",
                    f"{why} while the answer was going out; it may "
                    "have been posted, and it was not sent again",
                ),
            )
        else:
            await self._end(
                found, FAILED, RunError("delivery_abandoned", f"{why} before the answer went out")
            )

    async def deliver(self, text: str) -> Delivery:
        """Deliver the final answer `text` (Parked when a person must approve it first)."""
        # The answer is durable before its side effect can fire.
        await self._checkpoints.sync()
        # Without an interactions service nobody can decide: a gated answer is drafted and
        # fails (fail closed), never sent.
        gated = gates_replies(self._config.approvals) and not await self._granted()
        delivery, created = await self._orchestrator.begin_delivery(
            self._lease, self._target, text, awaiting_approval=gated
        )
        assert delivery is not None  # begin without find_only always answers one
        if created and delivery.state == AWAITING_APPROVAL and self._interactions is not None:
            await self._park_for_approval(delivery)
        return await self._carry_on(delivery)

    async def _granted(self) -> bool:
        if self._interactions is None:
            return False
        return await self._interactions.check_grant(SEND_REPLY, SEND_REPLY) is not None

    async def _park_for_approval(self, delivery: Delivery) -> NoReturn:
        if self._interactions is None:
            raise RuntimeError("an answer is gated only with an interactions service")
        interaction_id = await self._interactions.request_approval(
            tool_call_id=delivery.delivery_id,
            tool_name=SEND_REPLY,
            input={
                "channel_id": delivery.channel_id,
                "kind": delivery.kind,
                "address": self._target.address,
                "text": delivery.text,
            },
            risk=SEND_REPLY,
            summary=f"Send the answer to {delivery.kind} {self._target.address}: "
            f"{delivery.text[:SUMMARY_CHARS]!r}",
            policy=self._config.approvals,
            idempotency_key=delivery.delivery_id,
        )
        self._transcript.add(Role.ASSISTANT, ApprovalMarker(interaction_id, SEND_REPLY))
        raise Parked(RunStatus.WAITING_FOR_APPROVAL, interaction_id)

    async def _carry_on(self, delivery: Delivery) -> Delivery:
        if delivery.finished:
            return delivery
        if delivery.state == AWAITING_APPROVAL:
            return await self._decided(delivery)
        # A counted call may have landed: look before posting again.
        return await self._send(delivery, maybe_sent=delivery.attempts > 0)

    async def _decided(self, delivery: Delivery) -> Delivery:
        if self._interactions is None:
            return await self._end(
                delivery,
                FAILED,
                RunError("approval_unavailable", "no interactions service to ask for a decision"),
            )
        claim = await self._interactions.claim(SEND_REPLY, delivery.delivery_id)
        if claim is None:
            # Nothing decided to claim: an earlier attempt drafted the answer and died before
            # its approval was stored or the run parked on it (or after claiming it). Nothing
            # is sent without a decision: a person is asked again (the stray interaction, never
            # bound to the run, is swept as orphaned).
            await self._park_for_approval(delivery)
        if claim.decision in ("deny", "expired"):
            verdict = "denied" if claim.decision == "deny" else "expired before anyone decided"
            return await self._end(
                delivery,
                DENIED,
                RunError(f"approval_{claim.decision}", f"sending the answer was {verdict}"),
            )
        # What goes out is what was shown: the stored draft, never a regenerated answer.
        delivery = await self._orchestrator.record_delivery(
            self._lease, delivery.delivery_id, PENDING
        )
        return await self._send(delivery, maybe_sent=False)

    async def _end(
        self, delivery: Delivery, state: str, error: RunError | None = None, message_id: str = ""
    ) -> Delivery:
        return await self._orchestrator.record_delivery(
            self._lease, delivery.delivery_id, state, provider_message_id=message_id, error=error
        )

    async def _send(self, delivery: Delivery, *, maybe_sent: bool) -> Delivery:
        if self._interactions is None:
            return await self._end(
                delivery,
                FAILED,
                RunError(
                    "channel_unavailable",
                    "no interactions service to ask for the channel's credential",
                ),
            )
        try:
            sending = await self._interactions.channel_sending(delivery.channel_id)
        except NotFound:
            return await self._end(
                delivery,
                FAILED,
                RunError(
                    "channel_removed",
                    f"the channel connection {delivery.channel_id} was removed before the "
                    "answer went out",
                ),
            )
        async with delivery_session(self._settings.policy) as session:
            sender = sender_for(
                sending,
                self._target,
                session,
                status=self._status_of(delivery.channel_id),
                reconcile_s=self._settings.reconcile_s,
            )
            return await self._attempts(sender, delivery, maybe_sent=maybe_sent)

    def _status_of(self, channel_id: str) -> StatusLookup:
        async def lookup(callback_data: str) -> str | None:
            self._transcript.progressed_at = time.monotonic()
            return await self._orchestrator.find_channel_status(
                self._lease, channel_id, callback_data
            )

        return lookup

    async def _attempts(self, sender: Sender, delivery: Delivery, *, maybe_sent: bool) -> Delivery:
        retries = 0
        while True:
            if maybe_sent and sender.can_look_up:
                found = await self._look_up(sender, delivery)
                if found is not None:
                    return found
            # Counted before the call: an attempt after a crash knows it may have landed.
            lapses = await self._orchestrator.count_delivery_call(self._lease, delivery.delivery_id)
            self._transcript.progressed_at = time.monotonic()
            # Made only while the lease surely holds: a worker frozen after the count (its
            # answer waiting in its socket) that posted when it woke would post beside the
            # attempt that took the run over, looked, found nothing and posted. Checked here,
            # and again by the session right before the request is written (`posting_before`).
            if lapses is not None and datetime.now(UTC) >= lapses - SEND_MARGIN:
                raise StaleLease(
                    f"the lease of run {self._lease.run_id} lapses at {lapses.isoformat()}: "
                    "too late to post its answer under it"
                )
            try:
                with posting_before(lapses - SEND_MARGIN) if lapses is not None else nullcontext():
                    message_id = await sender.send(delivery.delivery_id, delivery.text)
            except Refused as refused:
                return await self._end(delivery, FAILED, refused.error)
            except Transient as transient:
                maybe_sent = transient.maybe_sent
                decision = self._policy.decide(transient.failure, retries)
                if not decision.retry:
                    if maybe_sent and sender.can_look_up:
                        found = await self._look_up(sender, delivery)
                        if found is not None:
                            return found
                    failure = transient.failure
                    return await self._end(
                        delivery,
                        FAILED,
                        RunError(
                            str(failure.code),
                            f"{failure.message} ({decision.reason})",
                            True,
                            failure.status,
                        ),
                    )
                retries += 1
                self._transcript.progressed_at = time.monotonic()
                await asyncio.sleep(decision.delay)  # the provider's Retry-After, or backoff
                continue
            return await self._end(delivery, SENT, message_id=message_id)

    async def _look_up(self, sender: Sender, delivery: Delivery) -> Delivery | None:
        """The delivery ended sent when the provider has it, unknown when it cannot say; None
        when it has none (sending is safe)."""
        try:
            found = await sender.find(delivery.delivery_id)
        except LookupFailed as exc:
            return await self._end(
                delivery,
                UNKNOWN,
                RunError(
                    "delivery_unknown",
                    f"the answer may have been posted before a crash and the provider could not "
                    f"be asked ({exc}); it was not sent again",
                ),
            )
        if found is None:
            return None
        return await self._end(delivery, SENT, message_id=found)
