"""A channel run's answer going out, as the orchestrator records it under the worker's lease.

The worker records its delivery before it calls the provider (`begin`), counts each provider call
and reports the outcome (`record`); an outcome's `delivery.*` event is appended in the same
transaction, so it lands once and before `run.completed`. The delivery id is derived here from
the tenant (the lease's, never the worker's word) and the run: every attempt finds the same one.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncEngine

from services.orchestrator.publisher import Publisher
from services.orchestrator.repositories import deliveries as repo
from services.orchestrator.repositories import progress
from tether.domain import Delivery, RunError, delivery_event, delivery_id
from tether.domain.deliveries import AWAITING_APPROVAL, OPEN, PENDING, STATES, may_move
from tether.errors import FailedPrecondition, InvalidArgument, StaleLease

KINDS = ("slack", "whatsapp", "webhook")


def _stale(run_id: str, epoch: int) -> StaleLease:
    return StaleLease(f"lease epoch {epoch} of run {run_id} is no longer current")


@dataclass(frozen=True, slots=True)
class Begun:
    """The run's delivery as recorded (None: find-only found none), and whether this call
    recorded it."""

    delivery: Delivery | None
    created: bool


@dataclass(frozen=True, slots=True)
class ChannelStatus:
    """A provider's status callback on a delivery."""

    provider_message_id: str
    status: str


class Deliveries:
    """The deliveries record, written under leases on this replica."""

    def __init__(self, engine: AsyncEngine, publisher: Publisher, *, lease_ttl_s: float) -> None:
        self._engine = engine
        self._publisher = publisher
        self._ttl = lease_ttl_s

    async def begin(
        self,
        run_id: str,
        epoch: int,
        *,
        channel_id: str,
        kind: str,
        text: str,
        awaiting_approval: bool,
        find_only: bool,
    ) -> Begun:
        """Record the run's delivery (or find it: an earlier attempt's record stands, with its
        text), under the lease."""
        if not find_only:
            if kind not in KINDS:
                raise InvalidArgument(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
            if not channel_id:
                raise InvalidArgument("channel_id is required")
            if not text:
                raise InvalidArgument("an answer to deliver has text")
        async with self._engine.begin() as conn:
            held = await progress.hold_lease(conn, run_id, epoch, self._ttl)
            if held is None:
                raise _stale(run_id, epoch)
            named = delivery_id(held.tenant_id, run_id)
            created = False
            if not find_only:
                created = await repo.record_delivery(
                    conn,
                    tenant_id=held.tenant_id,
                    delivery_id=named,
                    run_id=run_id,
                    channel_id=channel_id,
                    kind=kind,
                    state=AWAITING_APPROVAL if awaiting_approval else PENDING,
                    text=text,
                )
            found = await repo.find_delivery(conn, held.tenant_id, named)
        return Begun(found, created)

    async def record(
        self,
        run_id: str,
        epoch: int,
        named: str,
        *,
        state: str,
        provider_message_id: str = "",
        error: RunError | None = None,
        calls: int = 0,
    ) -> tuple[bool, Delivery, datetime]:
        """Move the delivery on under the lease: (moved, as recorded now, when the lease this
        write extended lapses). An outcome appends its event in the same transaction; one
        recorded already stands (moved False)."""
        if state not in STATES or calls < 0:
            raise InvalidArgument(f"state must be one of {', '.join(STATES)}")
        async with self._engine.begin() as conn:
            held = await progress.hold_lease(conn, run_id, epoch, self._ttl)
            if held is None:
                raise _stale(run_id, epoch)
            current = await repo.find_delivery(conn, held.tenant_id, named)
            if current is None or current.run_id != run_id:
                raise InvalidArgument(f"run {run_id} has no delivery {named!r}")
            if current.state not in OPEN:
                return False, current, held.lease_expires_at
            if not may_move(current.state, state):
                raise FailedPrecondition(
                    f"delivery {named} is {current.state}; it cannot become {state}"
                )
            moved = await repo.move_delivery(
                conn,
                held.tenant_id,
                named,
                state=state,
                provider_message_id=provider_message_id,
                error=error,
                calls=calls,
            )
            assert moved is not None  # the run's row is locked, and so is its one delivery
            stored = None
            if moved.finished:
                stored = await progress.checkpoint(
                    conn, run_id, epoch, self._ttl, [], [delivery_event(moved)], []
                )
                if stored is None:
                    raise _stale(run_id, epoch)
        if stored is not None:
            await self._publisher.publish(stored[0], stored[1], delivered=True)
        return True, moved, held.lease_expires_at

    async def status(
        self, run_id: str, epoch: int, channel_id: str, callback_data: str
    ) -> ChannelStatus | None:
        """The provider's status callback reporting on `callback_data`, under the lease."""
        async with self._engine.begin() as conn:
            held = await progress.hold_lease(conn, run_id, epoch, self._ttl)
            if held is None:
                raise _stale(run_id, epoch)
            row = await repo.find_status(conn, held.tenant_id, channel_id, callback_data)
        return None if row is None else ChannelStatus(row.provider_message_id, row.status)

    async def of_run(self, tenant_id: str, run_id: str) -> Delivery | None:
        """The run's delivery, for a read the caller was allowed."""
        async with self._engine.connect() as conn:
            return await repo.find_run_delivery(conn, tenant_id, run_id)
