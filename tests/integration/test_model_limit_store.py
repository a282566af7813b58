"""The model rate limits' shared state in PostgreSQL (services/orchestrator/limit_store.py): a
replica that starts resumes its buckets from the levels its predecessor wrote instead of
starting full, and the replicas' shares follow their connected workers, summing to 1.

Real PostgreSQL (the migrated template); each ModelLimits + LimitStore pair is one replica.
"""

from __future__ import annotations

import pytest
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from services.orchestrator.limit_store import LimitStore
from services.orchestrator.rate_limits import ModelLimits
from tether.db.schema.orchestrator_tables import model_limit_levels

LIMITS = "m: input_tokens=1000, window=60"


def replica(
    engine: AsyncEngine,
    name: str,
    workers: int = 1,
    share: float | None = None,
) -> tuple[ModelLimits, LimitStore]:
    limits = ModelLimits.from_text(LIMITS)
    count = {"n": workers}
    store = LimitStore(
        engine,
        limits,
        name,
        lambda: count["n"],
        replica_timeout_s=5.0,
        share_override=share,
    )
    return limits, store


def fill(limits: ModelLimits, step: int = 10) -> int:
    """Reserve `step` input tokens at a time until refused: how many were granted."""
    granted = 0
    while True:
        reservation, _ = limits.reserve(f"run-{granted}", 1, "cred", "m", step, 0)
        if not reservation:
            return granted
        granted += step


async def test_a_restarted_replica_resumes_the_spent_bucket_instead_of_starting_full(
    engine: AsyncEngine,
) -> None:
    first, store = replica(engine, "r1")
    await store.resume()
    await store.round()
    granted, _ = first.reserve("run-a", 1, "cred", "m", 900, 0)
    assert granted
    await store.round()  # the batched write; the replica then dies without a goodbye

    second, restarted = replica(engine, "r2")
    assert await restarted.resume() == 1
    # Before its first round it grants nothing: not from full buckets, not before its share.
    assert second.reserve("run-b", 1, "cred", "m", 10, 0)[0] == 0
    await restarted.round()
    # r1's heartbeat has not lapsed yet: r2 holds half the pool until it does.
    assert second.share == pytest.approx(0.5)
    # About 100 left pool-wide (plus the refill of the seconds since, 1000/60 a second):
    # not 1000.
    left = fill(second) / second.share
    assert 90 <= left <= 250, left
    # A credential nobody spent starts full.
    assert second.reserve("run-c", 1, "other", "m", 1000, 0)[0]


async def test_the_stored_level_refills_by_the_time_since_it_was_measured(
    engine: AsyncEngine,
) -> None:
    first, store = replica(engine, "r1")
    await store.round()
    assert first.reserve("run-a", 1, "cred", "m", 1000, 0)[0]
    await store.round()
    async with engine.begin() as conn:
        await conn.execute(
            text("UPDATE model_limit_levels SET measured_at = measured_at - interval '30 s'")
        )
    second, restarted = replica(engine, "r2")
    await restarted.resume()
    await restarted.round()
    # 30 s of a 60 s window: half the bucket back.
    assert 480 <= fill(second) / second.share <= 600


async def test_levels_are_written_only_while_they_changed(engine: AsyncEngine) -> None:
    limits, store = replica(engine, "r1")
    await store.round()
    limits.reserve("run-a", 1, "cred", "m", 100, 0)
    await store.round()
    assert store.level_writes == 1
    await store.round()
    await store.round()
    assert store.level_writes == 1  # nothing changed: heartbeats only
    limits.let_go("run-a")
    await store.round()
    assert store.level_writes == 2
    async with engine.connect() as conn:
        row = (await conn.execute(select(model_limit_levels))).one()
    assert (row.credential, row.model, row.replica_id) == ("cred", "m", "r1")
    assert row.input_tokens == pytest.approx(1000, abs=1)
    assert row.requests is None and row.output_tokens is None


async def test_shares_follow_connected_workers_and_sum_to_one(engine: AsyncEngine) -> None:
    a, store_a = replica(engine, "ra", workers=3)
    b, store_b = replica(engine, "rb", workers=1)
    for _ in range(2):  # each sees the other's heartbeat
        await store_a.round()
        await store_b.round()
    assert a.share == pytest.approx(0.75)
    assert b.share == pytest.approx(0.25)
    # Together they grant the limit, not more (within a few seconds' refill).
    total = fill(a) + fill(b)
    assert 950 <= total <= 1100, total

    # rb's heartbeat lapses (it died): ra's share becomes the whole limit.
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE model_limit_replicas SET heartbeat_at = now() - interval '1 minute' "
                "WHERE replica_id = 'rb'"
            )
        )
    await store_a.round()
    assert a.share == pytest.approx(1.0)


async def test_a_replica_that_leaves_stops_counting(engine: AsyncEngine) -> None:
    a, store_a = replica(engine, "ra", workers=2)
    _, store_b = replica(engine, "rb", workers=2)
    await store_a.round()
    await store_b.round()
    await store_a.round()
    assert a.share == pytest.approx(0.5)
    await store_b.leave()
    await store_a.round()
    assert a.share == pytest.approx(1.0)


async def test_the_operators_share_overrides_the_proportional_one(engine: AsyncEngine) -> None:
    a, store_a = replica(engine, "ra", workers=3, share=0.5)
    _, store_b = replica(engine, "rb", workers=1)
    await store_b.round()
    await store_a.round()
    assert a.share == 0.5
    assert 490 <= fill(a) <= 560


async def test_a_worker_connecting_changes_the_share_before_the_next_round(
    engine: AsyncEngine,
) -> None:
    count = {"n": 0}
    limits = ModelLimits.from_text(LIMITS)
    store = LimitStore(engine, limits, "ra", lambda: count["n"], replica_timeout_s=5.0)
    _, other = replica(engine, "rb", workers=1)
    await other.round()
    await store.round()
    assert limits.share < 0.05  # no worker here: it grants nothing anyway
    count["n"] = 3
    store.workers_changed()  # memory only: the others' workers as of the last round
    assert limits.share == pytest.approx(0.75)
