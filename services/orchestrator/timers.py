"""Timers: a run parked by its `wait_until` call until a due time, holding no worker, and its one
way back but a cancel: queued again once when due, with `timer.fired`, by whichever replica's
waker finds it first.

Exactly once across replicas and restarts: the waker locks due runs with SKIP LOCKED and moves
each with one guarded UPDATE (waiting-for-timer -> queued) appending `timer.fired` in the same
transaction, so a second replica finds it locked or already moved, and a replica killed before
its commit left it parked for the next look (this replica's own, or another's).
"""

from __future__ import annotations

import asyncio
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncEngine

from services.orchestrator.cancellation import cancel_instead
from services.orchestrator.publisher import Publisher
from services.orchestrator.repositories import leases as lease_repo
from services.orchestrator.repositories import queue as queue_repo
from services.orchestrator.repositories import timers as timers_repo
from services.orchestrator.repositories.transitions import apply
from tether import states
from tether.domain import timer_set
from tether.errors import InvalidArgument, StaleLease
from tether.states import RunStatus

# Due timers fired in one statement.
FIRE_BATCH = 500


def rfc3339(when: datetime) -> str:
    """`when` as the events carry it (RFC 3339, UTC, `Z`)."""
    return when.isoformat().replace("+00:00", "Z")


class Timers:
    """Parks runs on their timers and wakes them when due, on this replica."""

    def __init__(self, engine: AsyncEngine, publisher: Publisher) -> None:
        self._engine = engine
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._publisher = publisher
        # Set when this replica parks a run on a timer: the waker looks again at once, so a
        # timer sooner than its next look is not late.
        self.timer_set = asyncio.Event()

    async def park(self, run_id: str, epoch: int, wake_at: datetime, tool_call_id: str) -> bool:
        """Park a run until `wake_at`: lease released, session kept, no worker held. A run whose
        cancel was accepted ends cancelled instead."""
        if wake_at.tzinfo is None:
            raise InvalidArgument("wake_at is required to park a run waiting-for-timer")
        async with self._engine.begin() as conn:
            moved = await apply(
                conn,
                states.PARK_TIMER,
                run_id,
                epoch=epoch,
                events=[timer_set(tool_call_id, rfc3339(wake_at))],
                values={**lease_repo.lease_cleared(), "next_wake_at": wake_at},
            )
            if moved is not None:
                await lease_repo.end_attempt(conn, run_id, epoch, RunStatus.WAITING_FOR_TIMER.value)
            else:
                moved = await cancel_instead(conn, run_id, epoch)
                if moved is None:
                    raise StaleLease(f"lease epoch {epoch} of run {run_id} is no longer current")
        await self._publisher.publish(moved.run, moved.events)
        if moved.run.status == RunStatus.WAITING_FOR_TIMER.value:
            self.timer_set.set()
        else:
            self._publisher.wake_next(moved)  # a cancelled run hands its session on
        return True

    async def round(self) -> float | None:
        """Wake the runs whose timers are due; the seconds until the next one is (None: no run
        waits on a timer)."""
        # A full batch means more may be due now: fire them before resting (1,000 timers due
        # in one second would otherwise wait out ten of the rounds' least waits).
        while await self.fire_due() == FIRE_BATCH:
            pass
        async with self._autocommit.connect() as conn:
            return await queue_repo.next_wake_in(conn)

    async def fire_due(self, limit: int = FIRE_BATCH) -> int:
        """Queue the waiting-for-timer runs whose due time has passed, each once: one
        statement for up to `limit` of them."""
        async with self._engine.begin() as conn:
            fired = await timers_repo.fire_due(conn, limit, rfc3339)
        for one in fired:
            await self._publisher.publish(one.run, one.events)
        if fired:
            self._publisher.wake([one.run.run_id for one in fired])
        return len(fired)
