"""Schedules against the real PostgreSQL, with an injected clock: tickers racing on one database
admit each tick once; a tick fired again is admitted once by its key; a three-minute outage
under `latest` admits one catch-up run; the overlap policy; pause and resume; each tick its own
conversation, the creator's, routed to the agent; another tenant's schedule is NOT_FOUND; each
act audited."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from services.admission.domain import FreshnessPolicy
from services.admission.retention import Retention
from services.admission.schedules import (
    Actor,
    NewSchedule,
    Schedules,
    Ticker,
    TickerTiming,
)
from services.admission.service import Admitter, Disposition
from tether import apikeys
from tether.db.schema import audit_log, event_claims, messages, runs, schedules, sessions
from tether.errors import NotFound
from tether.settings import RetainingSettings
from tether.states import RunStatus
from tether.visibility import Viewer

T0 = datetime(2026, 3, 2, 9, 0, 0, tzinfo=UTC)
ALICE = Actor("t1", "alice", "key-alice")
EVE = Actor("t2", "eve", "key-eve")


class Clock:
    """The tickers' time, moved by the test."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
async def tenants(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        for tenant_id in ("t1", "t2"):
            await apikeys.ensure_tenant(conn, tenant_id)


def every_minute(overlap: str = "allow", catch_up: str = "latest") -> NewSchedule:
    return NewSchedule.parse(
        agent="reporter",
        cron="* * * * *",
        timezone="Europe/Paris",
        message="summarise the night's tickets",
        overlap=overlap,
        catch_up=catch_up,
        catch_up_window_s=0,
    )


def ticker(engine: AsyncEngine, clock: Clock, batch: int = 100) -> Ticker:
    return Ticker(engine, max_attempts=3, timing=TickerTiming(0.05, batch, 60.0), clock=clock)


async def runs_of(engine: AsyncEngine, schedule_id: str) -> list[dict[str, Any]]:
    """The runs a schedule's ticks admitted, oldest tick first."""
    async with engine.connect() as conn:
        rows = await conn.execute(
            select(runs, messages.c.context, messages.c.source)
            .join(messages, messages.c.message_id == runs.c.message_id)
            .where(messages.c.context["schedule_id"].astext == schedule_id)
            .order_by(messages.c.context["tick_at"].astext)
        )
        return [dict(row._mapping) for row in rows]


async def test_two_tickers_racing_on_one_database_admit_each_tick_once(
    engine: AsyncEngine, tenants: None
) -> None:
    clock = Clock(T0)
    store = Schedules(engine, clock)
    created = [await store.create(ALICE, every_minute()) for _ in range(20)]
    # Small batches: the two tickers interleave claim after claim over the same due set.
    first, second = ticker(engine, clock, batch=3), ticker(engine, clock, batch=3)
    for minute in (1, 2, 3):
        clock.now = T0 + timedelta(minutes=minute, seconds=1)
        a, b = await asyncio.gather(first.tick(), second.tick())
        assert len(a) + len(b) == 20
        assert set(a).isdisjoint(b)
    for schedule in created:
        ticks = [run["context"]["tick_at"] for run in await runs_of(engine, schedule.schedule_id)]
        assert ticks == [(T0 + timedelta(minutes=m)).isoformat() for m in (1, 2, 3)]


async def test_a_tick_fired_again_is_admitted_once_by_its_key(
    engine: AsyncEngine, tenants: None
) -> None:
    clock = Clock(T0)
    store = Schedules(engine, clock)
    schedule = await store.create(ALICE, every_minute())
    clock.now = T0 + timedelta(minutes=1, seconds=2)
    [run_id] = await ticker(engine, clock).tick()
    # A replica that read the schedule before the first one moved it on fires the same tick.
    async with engine.begin() as conn:
        await conn.execute(
            update(schedules)
            .where(schedules.c.schedule_id == schedule.schedule_id)
            .values(next_fire_at=T0 + timedelta(minutes=1))
        )
    assert await ticker(engine, clock).tick() == []
    assert [r["run_id"] for r in await runs_of(engine, schedule.schedule_id)] == [run_id]
    async with engine.connect() as conn:
        key = f"schedule:{schedule.schedule_id}@{int((T0 + timedelta(minutes=1)).timestamp())}"
        claims = await conn.execute(
            select(func.count()).select_from(event_claims).where(event_claims.c.key == key)
        )
        assert claims.scalar_one() == 1
        stored = (
            await conn.execute(
                select(schedules).where(schedules.c.schedule_id == schedule.schedule_id)
            )
        ).one()
    assert stored.last_run_id == run_id
    assert stored.next_fire_at == T0 + timedelta(minutes=2)


@pytest.mark.parametrize(("catch_up", "ticks"), [("latest", [4]), ("all", [2, 3, 4])])
async def test_a_three_minute_outage_is_caught_up_per_the_policy(
    engine: AsyncEngine, tenants: None, catch_up: str, ticks: list[int]
) -> None:
    clock = Clock(T0)
    store = Schedules(engine, clock)
    schedule = await store.create(ALICE, every_minute(catch_up=catch_up))
    clock.now = T0 + timedelta(minutes=1, seconds=1)
    assert len(await ticker(engine, clock).tick()) == 1
    # No ticker runs from 09:01:01 to 09:04:30: the ticks of 09:02, 09:03 and 09:04 pass.
    clock.now = T0 + timedelta(minutes=4, seconds=30)
    assert len(await ticker(engine, clock).tick()) == len(ticks)
    fired = [r["context"]["tick_at"] for r in await runs_of(engine, schedule.schedule_id)]
    assert fired == [(T0 + timedelta(minutes=m)).isoformat() for m in [1, *ticks]]
    # Caught up: nothing more until 09:05.
    assert await ticker(engine, clock).tick() == []


async def test_skip_passes_ticks_over_while_the_previous_run_is_active(
    engine: AsyncEngine, tenants: None
) -> None:
    clock = Clock(T0)
    store = Schedules(engine, clock)
    skipping = await store.create(ALICE, every_minute(overlap="skip"))
    allowing = await store.create(ALICE, every_minute(overlap="allow"))
    tickers = ticker(engine, clock)
    clock.now = T0 + timedelta(minutes=1, seconds=1)
    assert len(await tickers.tick()) == 2
    clock.now = T0 + timedelta(minutes=2, seconds=1)
    # The skipping schedule's first run is still queued: only the other one fires.
    assert len(await tickers.tick()) == 1
    assert len(await runs_of(engine, skipping.schedule_id)) == 1
    assert len(await runs_of(engine, allowing.schedule_id)) == 2
    [first] = await runs_of(engine, skipping.schedule_id)
    async with engine.begin() as conn:
        await conn.execute(
            update(runs)
            .where(runs.c.run_id == first["run_id"])
            .values(status=RunStatus.COMPLETED.value, finished_at=func.now())
        )
    clock.now = T0 + timedelta(minutes=3, seconds=1)
    assert len(await tickers.tick()) == 2
    assert len(await runs_of(engine, skipping.schedule_id)) == 2


async def test_each_tick_is_a_conversation_of_its_own_owned_by_the_creator(
    engine: AsyncEngine, tenants: None
) -> None:
    clock = Clock(T0)
    schedule = await Schedules(engine, clock).create(ALICE, every_minute())
    for minute in (1, 2):
        clock.now = T0 + timedelta(minutes=minute, seconds=1)
        await ticker(engine, clock).tick()
    fired = await runs_of(engine, schedule.schedule_id)
    assert [r["owner_principal_id"] for r in fired] == ["alice", "alice"]
    assert [r["tenant_id"] for r in fired] == ["t1", "t1"]
    assert [r["source"] for r in fired] == ["schedule", "schedule"]
    # Pinned to the schedule's agent, as a channel connection naming one pins its runs.
    assert [r["channel"] for r in fired] == ["schedule/reporter", "schedule/reporter"]
    assert [r["input_text"] for r in fired] == ["summarise the night's tickets"] * 2
    assert len({r["session_id"] for r in fired}) == 2
    async with engine.connect() as conn:
        scopes = await conn.execute(
            select(sessions.c.actor_scope).where(
                sessions.c.session_id.in_([r["session_id"] for r in fired])
            )
        )
        assert set(scopes.scalars()) == {"schedule:alice"}
    # Each heads its own session: neither waits behind the other.
    assert all(r["status"] == RunStatus.QUEUED.value for r in fired)


async def test_a_paused_schedule_does_not_fire_and_resumes_without_catching_up(
    engine: AsyncEngine, tenants: None
) -> None:
    clock = Clock(T0)
    store = Schedules(engine, clock)
    schedule = await store.create(ALICE, every_minute())
    paused = await store.set_paused(ALICE, schedule.schedule_id, True)
    assert paused.paused
    clock.now = T0 + timedelta(minutes=10, seconds=30)
    assert await ticker(engine, clock).tick() == []
    resumed = await store.set_paused(ALICE, schedule.schedule_id, False)
    assert not resumed.paused
    assert resumed.next_fire_at == T0 + timedelta(minutes=11)
    assert await ticker(engine, clock).tick() == []
    clock.now = T0 + timedelta(minutes=11, seconds=1)
    assert len(await ticker(engine, clock).tick()) == 1


async def test_another_tenants_schedule_is_not_found_and_unchanged(
    engine: AsyncEngine, tenants: None
) -> None:
    store = Schedules(engine, Clock(T0))
    schedule = await store.create(ALICE, every_minute())
    for act in (
        store.set_paused(EVE, schedule.schedule_id, True),
        store.set_paused(EVE, schedule.schedule_id, False),
        store.remove(EVE, schedule.schedule_id),
    ):
        with pytest.raises(NotFound) as refused:
            await act
        assert refused.value.message == f"schedule {schedule.schedule_id!r} not found"
    with pytest.raises(NotFound) as absent:
        await store.remove(EVE, "sch_absent")
    assert absent.value.message == "schedule 'sch_absent' not found"
    assert await store.list("t2") == []
    [kept] = await store.list("t1")
    assert kept == schedule


async def test_each_act_writes_one_audit_record(engine: AsyncEngine, tenants: None) -> None:
    store = Schedules(engine, Clock(T0))
    schedule = await store.create(ALICE, every_minute())
    await store.set_paused(ALICE, schedule.schedule_id, True)
    await store.set_paused(ALICE, schedule.schedule_id, True)  # paused already: no act
    await store.set_paused(ALICE, schedule.schedule_id, False)
    await store.remove(ALICE, schedule.schedule_id)
    async with engine.connect() as conn:
        rows = list(
            await conn.execute(
                select(audit_log.c.action, audit_log.c.detail)
                .where(audit_log.c.tenant_id == "t1")
                .order_by(audit_log.c.created_at, audit_log.c.id)
            )
        )
    assert [r.action for r in rows] == [
        "schedule.added",
        "schedule.paused",
        "schedule.resumed",
        "schedule.removed",
    ]
    for row in rows:
        assert row.detail["schedule_id"] == schedule.schedule_id
        assert row.detail["actor"] == {
            "kind": "key",
            "key_id": "key-alice",
            "principal_id": "alice",
        }
    assert await store.list("t1") == []


async def test_a_deleted_tenants_schedules_are_removed_in_batches(
    engine: AsyncEngine, tenants: None
) -> None:
    store = Schedules(engine, Clock(T0))
    for _ in range(3):
        await store.create(ALICE, every_minute())
    kept = await store.create(EVE, every_minute())
    retention = Retention(engine, RetainingSettings(retention_batch=2))
    assert await retention.delete_tenant("t1") == (2, True)
    assert await retention.delete_tenant("t1") == (1, False)
    assert await store.list("t1") == []
    assert await store.list("t2") == [kept]


async def test_skip_waits_for_a_retry_a_person_made_of_the_previous_tick_run(
    engine: AsyncEngine, tenants: None
) -> None:
    clock = Clock(T0)
    schedule = await Schedules(engine, clock).create(ALICE, every_minute(overlap="skip"))
    clock.now = T0 + timedelta(minutes=1, seconds=1)
    [first] = await ticker(engine, clock).tick()
    async with engine.begin() as conn:
        await conn.execute(
            update(runs)
            .where(runs.c.run_id == first)
            .values(status=RunStatus.FAILED.value, finished_at=func.now())
        )
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    retried = await admitter.retry(Viewer("t1", "alice", False), first, ALICE.audited())
    assert retried.disposition is Disposition.RETRIED
    # The retry of the tick's run is queued: the next tick is passed over.
    clock.now = T0 + timedelta(minutes=2, seconds=1)
    assert await ticker(engine, clock).tick() == []
    async with engine.begin() as conn:
        await conn.execute(
            update(runs)
            .where(runs.c.run_id == retried.run.run_id)
            .values(status=RunStatus.COMPLETED.value, finished_at=func.now())
        )
    clock.now = T0 + timedelta(minutes=3, seconds=1)
    assert len(await ticker(engine, clock).tick()) == 1
    assert len(await runs_of(engine, schedule.schedule_id)) == 3  # two ticks and the retry
