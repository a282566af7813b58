"""The deliveries record against the real PostgreSQL: recorded once per run under its lease
(every attempt finds the same one, with its first text), moved forward only, fenced by the
epoch, and an outcome's delivery.* event appended once, in the same transaction."""

from __future__ import annotations

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from services.admission.domain import FreshnessPolicy
from services.admission.service import Admitter
from services.orchestrator.claims import Claimed
from services.orchestrator.execution import Execution
from services.orchestrator.service import Runs
from tests.integration.test_admission import _tenant
from tests.integration.test_channel_origin import channel_message
from tether.db.schema import deliveries, run_event_log, runs
from tether.domain import RunError, delivery_id
from tether.errors import FailedPrecondition, StaleLease
from tether.states import RunStatus
from tether.testing.eventually import eventually
from tether.visibility import Viewer

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def leased(engine: AsyncEngine, execution: Execution, event_id: str) -> Claimed:
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    run_id = (await admitter.admit(channel_message("ch_dlv", event_id, "1700.5"))).run.run_id
    claimed = None
    while claimed is None or claimed.run.run_id != run_id:
        claimed = await execution.claims.claim("w-dlv", wait_s=0)
        assert claimed is not None
    return claimed


async def delivery_event_types(engine: AsyncEngine, run_id: str) -> list[str]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            select(run_event_log.c.type)
            .where(run_event_log.c.run_id == run_id, run_event_log.c.type.like("delivery.%"))
            .order_by(run_event_log.c.seq)
        )
        return list(rows.scalars())


async def test_every_attempt_finds_the_one_delivery_and_its_outcome_lands_once(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "t1")
    execution = Execution.build(engine, None, lease_ttl_s=30, claim_poll_s=60)
    claimed = await leased(engine, execution, "EvD1")
    run_id, epoch = claimed.run.run_id, claimed.run.lease_epoch
    rooms = execution.deliveries
    none = await rooms.begin(
        run_id, epoch, channel_id="", kind="", text="", awaiting_approval=False, find_only=True
    )
    assert none.delivery is None
    first = await rooms.begin(
        run_id,
        epoch,
        channel_id="ch_dlv",
        kind="slack",
        text="one",
        awaiting_approval=False,
        find_only=False,
    )
    again = await rooms.begin(
        run_id,
        epoch,
        channel_id="ch_dlv",
        kind="slack",
        text="two",
        awaiting_approval=False,
        find_only=False,
    )
    assert first.created and not again.created
    assert first.delivery is not None and again.delivery is not None
    assert again.delivery.delivery_id == first.delivery.delivery_id == delivery_id("t1", run_id)
    assert (again.delivery.state, again.delivery.text) == ("pending", "one"), (
        "the first text stands"
    )
    named = first.delivery.delivery_id
    moved, counted, lapses = await rooms.record(run_id, epoch, named, state="pending", calls=1)
    assert moved and counted.attempts == 1
    # The write extended the lease: it lapses one TTL from now, which the worker posts within.
    async with engine.connect() as conn:
        expires = (
            await conn.execute(select(runs.c.lease_expires_at).where(runs.c.run_id == run_id))
        ).scalar_one()
    assert lapses == expires
    moved, sent, _ = await rooms.record(
        run_id, epoch, named, state="sent", provider_message_id="1.2"
    )
    assert moved and (sent.state, sent.provider_message_id) == ("sent", "1.2")
    again_moved, stands, _ = await rooms.record(
        run_id, epoch, named, state="failed", error=RunError("late", "too late")
    )
    assert not again_moved and stands.state == "sent", "an outcome recorded stands"
    assert await delivery_event_types(engine, run_id) == ["delivery.sent"]


async def test_a_stale_epoch_records_nothing_and_awaiting_approval_never_becomes_sent(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "t1")
    execution = Execution.build(engine, None, lease_ttl_s=30, claim_poll_s=60)
    claimed = await leased(engine, execution, "EvD2")
    run_id, epoch = claimed.run.run_id, claimed.run.lease_epoch
    rooms = execution.deliveries
    with pytest.raises(StaleLease):
        await rooms.begin(
            run_id,
            epoch + 1,
            channel_id="ch_dlv",
            kind="slack",
            text="x",
            awaiting_approval=False,
            find_only=False,
        )
    drafted = await rooms.begin(
        run_id,
        epoch,
        channel_id="ch_dlv",
        kind="slack",
        text="draft",
        awaiting_approval=True,
        find_only=False,
    )
    assert drafted.delivery is not None and drafted.delivery.state == "awaiting-approval"
    with pytest.raises(FailedPrecondition):
        await rooms.record(run_id, epoch, drafted.delivery.delivery_id, state="sent")
    with pytest.raises(StaleLease):
        await rooms.record(run_id, epoch + 1, drafted.delivery.delivery_id, state="denied")
    assert await delivery_event_types(engine, run_id) == []


async def test_a_run_the_reaper_fails_leaves_its_delivery_unknown_not_open(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "t1")
    execution = Execution.build(engine, None, lease_ttl_s=0.2, claim_poll_s=60)
    admitter = Admitter(engine, max_attempts=1, freshness=FreshnessPolicy())
    run_id = (await admitter.admit(channel_message("ch_dlv", "EvD3", "1700.7"))).run.run_id
    claimed = None
    while claimed is None or claimed.run.run_id != run_id:
        claimed = await execution.claims.claim("w-dlv", wait_s=0)
        assert claimed is not None
    epoch = claimed.run.lease_epoch
    begun = await execution.deliveries.begin(
        run_id,
        epoch,
        channel_id="ch_dlv",
        kind="slack",
        text="maybe",
        awaiting_approval=False,
        find_only=False,
    )
    assert begun.delivery is not None
    await execution.deliveries.record(
        run_id, epoch, begun.delivery.delivery_id, state="pending", calls=1
    )
    # The worker dies mid-send, and so does every worker after it, until the attempts are spent.
    while True:
        await eventually(execution.recovery.reap_expired, timeout=10, what="the lease reaped")
        again = await execution.claims.claim("w-dlv", wait_s=0)
        if again is None:
            break
        assert again.run.run_id == run_id
    async with engine.connect() as conn:
        row = (await conn.execute(select(deliveries).where(deliveries.c.run_id == run_id))).one()
        types = list(
            (
                await conn.execute(
                    select(run_event_log.c.type)
                    .where(run_event_log.c.run_id == run_id)
                    .order_by(run_event_log.c.seq)
                )
            ).scalars()
        )
    assert row.state == "unknown", types
    assert "not sent again" in row.error["message"]
    assert types.index("delivery.unknown") < types.index("run.failed")


async def test_a_parked_draft_cancelled_ends_its_delivery_failed(engine: AsyncEngine) -> None:
    await _tenant(engine, "t1")
    execution = Execution.build(engine, None, lease_ttl_s=30, claim_poll_s=60)
    claimed = await leased(engine, execution, "EvD4")
    run_id, epoch = claimed.run.run_id, claimed.run.lease_epoch
    await execution.deliveries.begin(
        run_id,
        epoch,
        channel_id="ch_dlv",
        kind="slack",
        text="draft",
        awaiting_approval=True,
        find_only=False,
    )
    assert await execution.pauses.park(run_id, epoch, RunStatus.WAITING_FOR_APPROVAL, "int_dlv")
    runs = Runs(engine, execution.publisher, None)
    await runs.request_cancellation(Viewer("t1", "", all_runs=True), run_id, "changed my mind")
    async with engine.connect() as conn:
        row = (await conn.execute(select(deliveries).where(deliveries.c.run_id == run_id))).one()
    assert (row.state, row.error["code"]) == ("failed", "delivery_abandoned")
    assert await delivery_event_types(engine, run_id) == ["delivery.failed"]
