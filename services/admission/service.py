"""Admission: the idempotency gate and the duplicate decision table, before any paid work."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.admission import repository as repo
from services.admission.domain import FreshnessPolicy, InboundEvent
from tether.bus import Bus
from tether.errors import AlreadyExists, FailedPrecondition
from tether.ids import new_id
from tether.states import TERMINAL, RunStatus


class Disposition(enum.StrEnum):
    """What admission did with an event."""

    CREATED = "created"
    ATTACHED = "attached"
    REPLAYED = "replayed"
    RETRIED = "retried"


@dataclass(frozen=True)
class Admission:
    """The outcome: the run that handles the event and how it was reached."""

    disposition: Disposition
    run: Row[Any]


class Admitter:
    """Admits events: claim, session, message and queued run in one transaction."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        max_attempts: int,
        freshness: FreshnessPolicy,
        bus: Bus | None = None,
    ) -> None:
        self._engine = engine
        # Single-statement work needs no BEGIN/COMMIT round trips.
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._max_attempts = max_attempts
        self._freshness = freshness
        self._bus = bus

    async def admit(self, event: InboundEvent, *, traceparent: str | None = None) -> Admission:
        """Admit `event`, or apply the duplicate decision table to it."""
        request_hash = event.request_hash()
        run_id = new_id("run")
        async with self._autocommit.connect() as conn:
            run = await repo.admit_new(
                conn,
                event=event,
                request_hash=request_hash,
                run_id=run_id,
                session_id=new_id("ses"),
                message_id=new_id("msg"),
                max_attempts=self._max_attempts,
                traceparent=traceparent,
            )
            decided = (
                Admission(Disposition.CREATED, run)
                if run is not None
                else await self._duplicate(conn, event, request_hash)
            )
        # A retry takes a transaction of its own once this connection is back in the pool:
        # holding one while waiting for another deadlocks a pool that every caller holds.
        outcome = (
            decided
            if isinstance(decided, Admission)
            else await self._reclaim(event, decided, traceparent)
        )
        if outcome.disposition in (Disposition.CREATED, Disposition.RETRIED) and self._bus:
            self._bus.notify_queued(outcome.run.run_id)
        return outcome

    async def _duplicate(
        self, conn: AsyncConnection, event: InboundEvent, request_hash: bytes
    ) -> Admission | Row[Any]:
        """The duplicate decision table: an admission, or the failed or cancelled run that a
        new run retries (with lineage)."""
        claim = await repo.find_claim(conn, event)
        run = claim.run
        # Another principal's run is never attached to, replayed or retried for this caller:
        # the same key sent by another principal is the conflict it would be with other content.
        if claim.request_hash != request_hash or run.owner_principal_id != event.principal_id:
            raise AlreadyExists(
                f"event {event.idempotency_key!r} was already admitted with different content; "
                "a changed message needs a new event id",
                code="idempotency_conflict",
                details={"idempotency_key": event.idempotency_key},
            )
        status = RunStatus(run.status)
        if status not in TERMINAL:
            return Admission(Disposition.ATTACHED, run)
        if status is RunStatus.COMPLETED:
            if claim.age_s <= self._freshness.replay_window_s:
                return Admission(Disposition.REPLAYED, run)
            if self._freshness.stale != "reprocess":
                raise FailedPrecondition(
                    f"event {event.idempotency_key!r} completed "
                    f"{int(claim.age_s)} s ago, outside the "
                    f"{int(self._freshness.replay_window_s)} s replay window; "
                    "send it with a new event id to process it again",
                    code="stale_replay",
                    details={"run_id": run.run_id},
                )
        elif not (run.error or {}).get("retryable", True):
            # A deterministic failure would fail again: report it rather than spend again.
            return Admission(Disposition.REPLAYED, run)
        return run

    async def _reclaim(
        self, event: InboundEvent, previous: Row[Any], traceparent: str | None
    ) -> Admission:
        """Rebind the claim to a fresh run with lineage; a losing racer attaches to the winner."""
        run_id = new_id("run")
        async with self._engine.begin() as conn:
            if not await repo.rebind_claim(conn, event, previous.run_id, run_id):
                return Admission(Disposition.ATTACHED, (await repo.find_claim(conn, event)).run)
            run = await repo.insert_queued_run(
                conn,
                run_id=run_id,
                event=event,
                session_id=previous.session_id,
                message_id=previous.message_id,
                max_attempts=self._max_attempts,
                parent_run_id=previous.run_id,
                root_run_id=previous.root_run_id,
                reason="redelivered",
                traceparent=traceparent,
            )
        return Admission(Disposition.RETRIED, run)
