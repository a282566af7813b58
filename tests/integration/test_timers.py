"""The timers' statements against the real PostgreSQL: a park under the lease, and a waker that
queues a due run exactly once however many wakers look at the same moment."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from services.admission.domain import FreshnessPolicy
from services.admission.service import Admitter
from services.orchestrator.publisher import Publisher
from services.orchestrator.timers import Timers
from tests.integration.test_admission import _tenant, chat
from tests.integration.test_transitions import _claim
from tether.db.engine import create_engine
from tether.db.schema import run_event_log, runs
from tether.errors import StaleLease

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def _leased_run(engine: AsyncEngine, event_id: str) -> str:
    await _tenant(engine, "t1")
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    run_id = (await admitter.admit(chat(event_id, conversation=event_id))).run.run_id
    await _claim(engine, run_id, "w-1", 30)
    return str(run_id)


async def _events(engine: AsyncEngine, run_id: str) -> list[str]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            select(run_event_log.c.type).where(run_event_log.c.run_id == run_id).order_by("seq")
        )
        return [r.type for r in rows]


async def _row(engine: AsyncEngine, run_id: str) -> object:
    async with engine.connect() as conn:
        return (await conn.execute(select(runs).where(runs.c.run_id == run_id))).one()


async def test_wakers_racing_for_one_due_timer_fire_it_once(
    engine: AsyncEngine, db_url: str
) -> None:
    run_id = await _leased_run(engine, "e-race")
    due = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=1)
    assert await Timers(engine, Publisher(None)).park(run_id, 1, due, "toolu_1")
    parked = await _row(engine, run_id)
    assert (parked.status, parked.next_wake_at, parked.lease_owner) == (  # type: ignore[attr-defined]
        "waiting-for-timer",
        due,
        None,
    )
    # Four replicas' wakers, each on its own pool, look at once.
    engines = [create_engine(db_url, pool_size=2) for _ in range(4)]
    try:
        fired = await asyncio.gather(*(Timers(e, Publisher(None)).fire_due() for e in engines))
    finally:
        for e in engines:
            await e.dispose()
    assert sorted(fired) == [0, 0, 0, 1]
    woken = await _row(engine, run_id)
    assert (woken.status, woken.next_wake_at) == ("queued", None)  # type: ignore[attr-defined]
    events = await _events(engine, run_id)
    assert events[-3:] == ["timer.set", "timer.fired", "run.queued"]
    assert events.count("timer.fired") == 1


async def test_a_timer_not_yet_due_is_left_and_its_due_time_reported(engine: AsyncEngine) -> None:
    run_id = await _leased_run(engine, "e-later")
    timers = Timers(engine, Publisher(None))
    await timers.park(run_id, 1, datetime.now(UTC) + timedelta(seconds=60), "toolu_1")
    assert timers.timer_set.is_set(), "the waker is nudged to look again"
    due_in = await timers.round()
    assert due_in is not None and 55 < due_in <= 60
    assert (await _row(engine, run_id)).status == "waiting-for-timer"  # type: ignore[attr-defined]
    assert "timer.fired" not in await _events(engine, run_id)


async def test_a_park_under_a_stale_lease_is_refused_and_one_after_a_cancel_ends_cancelled(
    engine: AsyncEngine,
) -> None:
    timers = Timers(engine, Publisher(None))
    stale = await _leased_run(engine, "e-stale")
    with pytest.raises(StaleLease):
        await timers.park(stale, 7, datetime.now(UTC) + timedelta(seconds=5), "toolu_1")
    assert (await _row(engine, stale)).status == "running"  # type: ignore[attr-defined]

    cancelled = await _leased_run(engine, "e-cancel")
    async with engine.begin() as conn:
        await conn.execute(
            update(runs)
            .where(runs.c.run_id == cancelled)
            .values(cancel_requested_at=datetime.now(UTC))
        )
    await timers.park(cancelled, 1, datetime.now(UTC) + timedelta(seconds=5), "toolu_1")
    gone = await _row(engine, cancelled)
    assert (gone.status, gone.next_wake_at) == ("cancelled", None)  # type: ignore[attr-defined]
    assert "timer.set" not in await _events(engine, cancelled)
