"""What keeping a run running writes, against the real PostgreSQL: a lease's renewal and a
checkpoint rewrite the run's row as HOT updates (a new version on the same page, no new entry in
any index of the table), and the reaper still finds a lapsed lease among the running runs. A
renewal locks its runs in the order a group commit writes them, so the two never deadlock."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import func, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.admission.domain import FreshnessPolicy
from services.admission.service import Admitter
from services.orchestrator.execution import Execution
from services.orchestrator.repositories import leases, progress, queue
from tests.integration.test_admission import _tenant, chat
from tether.db.schema import runs
from tether.domain import Part, Role, Text, part_updated
from tether.testing.eventually import eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")

RUNS = 4
TTL_S = 30.0
_UPDATES = text(
    "SELECT pg_stat_get_xact_tuples_updated('runs'::regclass) AS updated, "
    "pg_stat_get_xact_tuples_hot_updated('runs'::regclass) AS hot"
)


async def _held(engine: AsyncEngine) -> list[tuple[str, int]]:
    await _tenant(engine, "t1")
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    for i in range(RUNS):
        await admitter.admit(chat(f"e{i}", conversation=f"c{i}"))
    execution = Execution.build(engine, None, lease_ttl_s=TTL_S, claim_poll_s=60)
    claimed = await execution.claims.claim_many("w-1", RUNS)
    assert len(claimed) == RUNS
    return sorted((c.run.run_id, c.run.lease_epoch) for c in claimed)


async def _updates(conn: AsyncConnection) -> Any:
    """This transaction's row updates of runs so far, and how many were HOT."""
    return (await conn.execute(_UPDATES)).one()


async def test_a_renewal_of_every_lease_held_is_a_hot_update_of_each_run(
    engine: AsyncEngine,
) -> None:
    held = await _held(engine)
    for _ in range(3):
        async with engine.begin() as conn:
            before = await _updates(conn)
            renewed = await leases.renew(conn, held, TTL_S)
            after = await _updates(conn)
        assert sorted((r.run_id, r.lease_epoch) for r in renewed) == held
        assert after.updated - before.updated == RUNS
        assert after.hot - before.hot == RUNS, "a renewal added index entries"


async def test_a_renewal_locks_its_runs_in_run_id_order_as_a_group_commit_does(
    engine: AsyncEngine,
) -> None:
    """A group commit writes its runs in run-id order (tether.db.committer). A renewal that
    locked the runs it renews in another order (the table's, from a hash join over a scan of
    runs) deadlocked with it: seen in the bench, PostgreSQL aborting a group of completions."""
    held = await _held(engine)
    first, last = held[0][0], held[-1][0]
    async with engine.begin() as conn:
        # The first run's row moves to the table's end (too long for its page): the table's
        # order is no longer the runs' order.
        await conn.execute(update(runs).where(runs.c.run_id == first).values(input_text="x" * 6000))
    lock = select(runs.c.run_id).with_for_update(key_share=False)
    async with engine.connect() as group, engine.connect() as renewing:
        # A prepared statement's generic plan, as asyncpg's statement cache gets after five runs.
        await renewing.execute(text("SET plan_cache_mode = force_generic_plan"))
        await group.begin()
        await group.execute(lock.where(runs.c.run_id == first))  # the group's first write
        renewal = asyncio.create_task(leases.renew(renewing, held, TTL_S))

        async def waiting() -> bool:
            async with engine.connect() as probe:
                blocked = await probe.execute(
                    text(
                        "SELECT count(*) FROM pg_stat_activity "
                        "WHERE wait_event_type = 'Lock' "
                        "AND query LIKE '%SET lease_expires_at=(now()%'"
                    )
                )
                return bool(blocked.scalar_one())

        await eventually(waiting, what="the renewal to wait for the group's lock")
        # The group's next write: the renewal, locking in run-id order, holds none of its runs
        # yet, so this lock is free; locking in the table's order it held this one, a deadlock.
        await asyncio.wait_for(group.execute(lock.where(runs.c.run_id == last)), 10)
        await group.commit()
        renewed = await asyncio.wait_for(renewal, 10)
        await renewing.commit()
    assert sorted((r.run_id, r.lease_epoch) for r in renewed) == held


async def test_a_checkpoint_is_a_hot_update_of_its_run(engine: AsyncEngine) -> None:
    held = await _held(engine)
    for round_ in range(3):
        async with engine.begin() as conn:
            before = await _updates(conn)
            for run_id, epoch in held:
                part = Part(0, Role.ASSISTANT, Text("so far " * (round_ + 1)))
                written = await progress.checkpoint(
                    conn, run_id, epoch, TTL_S, [part], [part_updated(part)], []
                )
                assert written is not None
            after = await _updates(conn)
        assert after.updated - before.updated == RUNS
        assert after.hot - before.hot == RUNS, "a checkpoint added index entries"


async def test_the_reaper_finds_a_lapsed_lease_among_the_running_runs(
    engine: AsyncEngine,
) -> None:
    held = await _held(engine)
    lapsed, *alive = held
    async with engine.begin() as conn:
        # One lease lapses (its keepalives stopped); the others are renewed.
        await conn.execute(
            update(runs)
            .where(runs.c.run_id == lapsed[0])
            .values(lease_expires_at=func.now() - timedelta(seconds=1))
        )
        await leases.renew(conn, alive, TTL_S)
    async with engine.begin() as conn:
        expired = await leases.expired_leases(conn, 10)
        assert [row.run_id for row in expired] == [lapsed[0]]
        assert await queue.next_expiry_in(conn) is not None
