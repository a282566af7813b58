"""The webhook dispatcher's statements on real PostgreSQL: a run's deliveries are claimed one at
a time in seq order; two replicas claiming at once take disjoint deliveries (SKIP LOCKED) and a
claimed one is not due again while its lease lasts; an outcome is recorded only by the try that
claimed it; a delivery is given up after the window unless its endpoint is still within its own
failing window, and an endpoint failing for the window is disabled with its pending deliveries."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from services.orchestrator.repositories import webhook_dispatch as repo
from services.orchestrator.repositories import webhooks as reads
from tether.db.schema import webhook_deliveries, webhook_subscriptions

pytestmark = pytest.mark.asyncio(loop_scope="session")

TENANT = "t-hooks"
LEASE = timedelta(minutes=1)
HOUR = timedelta(hours=1)


async def _seed(engine: AsyncEngine, deliveries: list[tuple[str, int]]) -> None:
    async with engine.begin() as conn:
        await reads.insert_subscription(
            conn,
            tenant_id=TENANT,
            subscription_id="whsub_1",
            url="https://8.8.8.8/hook",
            events=["run.completed"],
            created_by="tester",
        )
        for run_id, seq in deliveries:
            await conn.execute(
                insert(webhook_deliveries).values(
                    tenant_id=TENANT,
                    delivery_id=f"msg_{run_id}_{seq}",
                    subscription_id="whsub_1",
                    run_id=run_id,
                    seq=seq,
                    event_type="run.completed",
                )
            )


async def _claim(engine: AsyncEngine, limit: int = 10) -> list[reads.Claimed]:
    async with engine.begin() as conn:
        return await repo.claim_due(conn, limit, LEASE)


def _names(claimed: list[reads.Claimed]) -> set[str]:
    return {c.delivery.delivery_id for c in claimed}


async def test_a_runs_deliveries_are_claimed_one_at_a_time_in_order(engine: AsyncEngine) -> None:
    await _seed(engine, [("r1", 1), ("r1", 2), ("r1", 3), ("r2", 5)])
    first = await _claim(engine)
    assert _names(first) == {"msg_r1_1", "msg_r2_5"}
    assert all(c.url == "https://8.8.8.8/hook" and c.delivery.attempts == 1 for c in first)
    # Leased: nothing is due again, and r1's next waits on its first.
    assert await _claim(engine) == []
    [r1] = [c for c in first if c.delivery.run_id == "r1"]
    async with engine.begin() as conn:
        assert await repo.mark_sent(conn, r1.delivery, 204)
    assert _names(await _claim(engine)) == {"msg_r1_2"}


async def test_two_replicas_claiming_at_once_take_disjoint_deliveries(engine: AsyncEngine) -> None:
    await _seed(engine, [("r1", 1), ("r2", 1), ("r3", 1)])
    async with engine.begin() as one, engine.begin() as two:
        mine = await repo.claim_due(one, 2, LEASE)
        theirs = await repo.claim_due(two, 2, LEASE)
    assert len(mine) == 2 and len(theirs) == 1
    assert not _names(mine) & _names(theirs)


async def test_only_the_try_that_claimed_records_its_outcome(engine: AsyncEngine) -> None:
    await _seed(engine, [("r1", 1)])
    [first] = await _claim(engine)
    # Its lease ran out (a replica stalled); another try claims it.
    async with engine.begin() as conn:
        await conn.execute(update(webhook_deliveries).values(next_attempt_at=func.now()))
    [second] = await _claim(engine)
    assert second.delivery.attempts == 2
    async with engine.begin() as conn:
        assert not await repo.mark_sent(conn, first.delivery, 200)
        stale = await repo.mark_failed(
            conn, first.delivery, http_status=500, error="x", retry_in=HOUR, give_up_after=HOUR
        )
        assert stale is None
        assert await repo.mark_sent(conn, second.delivery, 200)


async def _backdate(
    engine: AsyncEngine, *, first_try: timedelta, failing: timedelta | None
) -> None:
    """The claimed deliveries first tried `first_try` ago; the endpoint failing for `failing`."""
    async with engine.begin() as conn:
        await conn.execute(
            update(webhook_deliveries)
            .where(webhook_deliveries.c.first_attempt_at.is_not(None))
            .values(first_attempt_at=func.now() - first_try)
        )
        since = None if failing is None else func.now() - failing
        await conn.execute(update(webhook_subscriptions).values(failing_since=since))


async def test_a_delivery_waits_while_its_endpoint_is_within_its_window_then_is_given_up(
    engine: AsyncEngine,
) -> None:
    await _seed(engine, [("r1", 1)])
    [claimed] = await _claim(engine)
    # First tried two hours ago; the endpoint has been failing for ten minutes only.
    await _backdate(engine, first_try=2 * HOUR, failing=timedelta(minutes=10))
    async with engine.begin() as conn:
        left = await repo.mark_failed(
            conn, claimed.delivery, http_status=500, error="boom", retry_in=HOUR, give_up_after=HOUR
        )
        assert left == "pending"
        assert await repo.disable_if_failing(conn, TENANT, "whsub_1", HOUR) is None


async def test_a_delivery_failing_while_its_endpoint_takes_others_is_given_up(
    engine: AsyncEngine,
) -> None:
    await _seed(engine, [("r1", 1), ("r1", 2)])
    [claimed] = await _claim(engine)
    await _backdate(engine, first_try=2 * HOUR, failing=None)
    async with engine.begin() as conn:
        left = await repo.mark_failed(
            conn, claimed.delivery, http_status=400, error="bad", retry_in=HOUR, give_up_after=HOUR
        )
    assert left == "failed"
    # The run's next event goes on.
    assert _names(await _claim(engine)) == {"msg_r1_2"}


async def test_an_endpoint_failing_for_the_window_is_disabled_with_its_pending_deliveries(
    engine: AsyncEngine,
) -> None:
    await _seed(engine, [("r1", 1), ("r1", 2), ("r2", 1)])
    claimed = await _claim(engine)
    await _backdate(engine, first_try=2 * HOUR, failing=2 * HOUR)
    async with engine.begin() as conn:
        left = await repo.mark_failed(
            conn,
            claimed[0].delivery,
            http_status=503,
            error="down",
            retry_in=HOUR,
            give_up_after=HOUR,
        )
        assert left == "failed"
        disabled = await repo.disable_if_failing(conn, TENANT, "whsub_1", HOUR)
        assert disabled is not None and disabled.disabled_at is not None
        assert await repo.disable_if_failing(conn, TENANT, "whsub_1", HOUR) is None
        statuses = (await conn.execute(select(webhook_deliveries.c.status))).scalars().all()
    assert set(statuses) == {"failed"}
    # A disabled subscription is not scanned; a redelivered delivery is sent all the same.
    async with engine.begin() as conn:
        assert await repo.lock_subscriptions_to_scan(conn, 10) == []
        requeued = await reads.requeue_delivery(conn, TENANT, "msg_r2_1")
        assert requeued is not None and requeued.status == "pending"
        assert await reads.requeue_delivery(conn, "another-tenant", "msg_r2_1") is None
    assert _names(await _claim(engine)) == {"msg_r2_1"}


async def test_the_log_forgets_only_what_no_scan_will_look_at_again(engine: AsyncEngine) -> None:
    await _seed(engine, [("gone", 1), ("gone", 2), ("pending", 1)])
    async with engine.begin() as conn:
        await conn.execute(
            update(webhook_deliveries)
            .where(webhook_deliveries.c.run_id == "gone")
            .values(status="sent", created_at=func.now() - 2 * HOUR)
        )
        await conn.execute(
            update(webhook_deliveries)
            .where(webhook_deliveries.c.run_id == "pending")
            .values(created_at=func.now() - 2 * HOUR)
        )
        [subscription] = await reads.list_subscriptions(conn, TENANT)
        # Kept while younger than the window, then at most a batch at a time.
        assert await repo.prune_log(conn, subscription, 3 * HOUR, 10) == 0
        assert await repo.prune_log(conn, subscription, HOUR, 1) == 1
        assert await repo.prune_log(conn, subscription, HOUR, 10) == 1
        assert await repo.prune_log(conn, subscription, HOUR, 10) == 0
        left = (await conn.execute(select(webhook_deliveries.c.delivery_id))).scalars().all()
    assert left == ["msg_pending_1"]


async def test_the_next_due_time_skips_deliveries_waiting_on_an_earlier_one(
    engine: AsyncEngine,
) -> None:
    await _seed(engine, [("r1", 1), ("r1", 2)])
    async with engine.connect() as conn:
        due_now = await repo.earliest_due(conn)
    [claimed] = await _claim(engine)
    async with engine.connect() as conn:
        # r1#2 is due but waits on r1#1, leased: the next round is due when the lease ends.
        due = await repo.earliest_due(conn)
        now = (await conn.execute(select(func.now()))).scalar_one()
    assert claimed.delivery.seq == 1 and due_now is not None and due is not None
    assert due - now > LEASE - timedelta(seconds=5)
