"""Admission against the real PostgreSQL: the idempotency gate and the duplicate decision table."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from services.admission.adapters import normalise
from services.admission.domain import FreshnessPolicy, InboundEvent
from services.admission.service import Admitter, Disposition
from tether import apikeys
from tether.db.schema import event_claims, messages, run_event_log, run_events, runs, sessions
from tether.domain import run_queued
from tether.errors import AlreadyExists, FailedPrecondition
from tether.states import RunStatus
from tether.v1 import admission_pb2


async def _tenant(engine: AsyncEngine, *tenant_ids: str) -> None:
    async with engine.begin() as conn:
        for tenant_id in tenant_ids:
            await apikeys.ensure_tenant(conn, tenant_id)


def chat(
    event_id: str = "evt-1",
    text: str = "hello",
    *,
    tenant: str = "t1",
    principal: str = "alice",
    conversation: str = "c1",
) -> InboundEvent:
    return normalise(
        admission_pb2.AdmitRequest(
            caller=admission_pb2.Caller(tenant_id=tenant, principal_id=principal),
            chat=admission_pb2.ChatInput(
                event_id=event_id, conversation_id=conversation, text=text
            ),
        )
    )


def messaging(
    event_id: str,
    thread: str,
    *,
    tenant: str,
    text: str = "any update?",
    principal: str = "whatsapp-bridge",
) -> InboundEvent:
    return normalise(
        admission_pb2.AdmitRequest(
            caller=admission_pb2.Caller(tenant_id=tenant, principal_id=principal),
            messaging=admission_pb2.MessagingWebhookInput(
                provider="whatsapp",
                provider_event_id=event_id,
                thread_id=thread,
                sender_id="guest-1",
                text=text,
            ),
        )
    )


def task_status(event_id: str, task_id: str, *, principal: str) -> InboundEvent:
    return normalise(
        admission_pb2.AdmitRequest(
            caller=admission_pb2.Caller(tenant_id="acme", principal_id=principal),
            task_status=admission_pb2.TaskStatusInput(
                task_id=task_id, status_event_id=event_id, status="done"
            ),
        )
    )


async def counts(engine: AsyncEngine) -> dict[str, int]:
    async with engine.connect() as conn:
        return {
            t.name: (await conn.execute(select(func.count()).select_from(t))).scalar_one()
            for t in (event_claims, sessions, messages, runs, run_events)
        }


async def finish(engine: AsyncEngine, run_id: str, status: RunStatus, **values: Any) -> None:
    """Test setup: put a run into a terminal state as the orchestrator would have."""
    async with engine.begin() as conn:
        await conn.execute(
            update(runs)
            .where(runs.c.run_id == run_id)
            .values(status=status.value, finished_at=func.now(), **values)
        )


@pytest.fixture
def admitter(engine: AsyncEngine) -> Admitter:
    return Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())


async def test_first_delivery_writes_claim_session_message_and_queued_run(
    engine: AsyncEngine, admitter: Admitter
) -> None:
    await _tenant(engine, "t1")
    outcome = await admitter.admit(chat())
    assert outcome.disposition is Disposition.CREATED
    assert outcome.run.status == "queued"
    assert outcome.run.root_run_id == outcome.run.run_id
    assert await counts(engine) == {
        "event_claims": 1,
        "sessions": 1,
        "messages": 1,
        "runs": 1,
        "run_events": 0,  # its run.queued is read from the run's row (0048)
    }
    async with engine.connect() as conn:
        event = (await conn.execute(select(run_event_log))).one()
    assert (event.seq, event.type, event.payload) == (
        1,
        "run.queued",
        run_queued(1, "admitted").payload,
    )
    assert event.created_at == outcome.run.created_at


async def test_fifty_concurrent_deliveries_yield_one_run(
    engine: AsyncEngine, admitter: Admitter
) -> None:
    await _tenant(engine, "t1")
    event = chat("evt-burst", "where is my order?")
    outcomes = await asyncio.gather(*(admitter.admit(event) for _ in range(50)))
    run_ids = {o.run.run_id for o in outcomes}
    assert len(run_ids) == 1
    dispositions = sorted(o.disposition for o in outcomes)
    assert dispositions.count(Disposition.CREATED) == 1
    assert dispositions.count(Disposition.ATTACHED) == 49
    assert (await counts(engine))["runs"] == 1
    assert (await counts(engine))["messages"] == 1


async def test_same_key_different_content_is_a_conflict_and_writes_nothing(
    engine: AsyncEngine, admitter: Admitter
) -> None:
    await _tenant(engine, "t1")
    await admitter.admit(chat("evt-1", "yes"))
    before = await counts(engine)
    with pytest.raises(AlreadyExists) as info:
        await admitter.admit(chat("evt-1", "no"))
    assert info.value.code == "idempotency_conflict"
    assert await counts(engine) == before


async def test_completed_duplicate_replays_the_stored_outcome(
    engine: AsyncEngine, admitter: Admitter
) -> None:
    await _tenant(engine, "t1")
    first = await admitter.admit(chat())
    await finish(engine, first.run.run_id, RunStatus.COMPLETED, result_text="It ships Monday.")
    before = await counts(engine)
    again = await admitter.admit(chat())
    assert again.disposition is Disposition.REPLAYED
    assert again.run.run_id == first.run.run_id
    assert again.run.result_text == "It ships Monday."
    assert await counts(engine) == before


async def test_stale_replay_is_refused_by_default_and_writes_nothing(engine: AsyncEngine) -> None:
    await _tenant(engine, "t1")
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy(replay_window_s=0))
    first = await admitter.admit(chat("evt-yes", "yes"))
    await finish(engine, first.run.run_id, RunStatus.COMPLETED, result_text="Booked.")
    before = await counts(engine)
    with pytest.raises(FailedPrecondition) as info:
        await admitter.admit(chat("evt-yes", "yes"))
    assert info.value.code == "stale_replay"
    assert await counts(engine) == before


async def test_stale_replay_reprocess_policy_creates_a_run_with_lineage(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "t1")
    policy = FreshnessPolicy(replay_window_s=0, stale="reprocess")
    admitter = Admitter(engine, max_attempts=3, freshness=policy)
    first = await admitter.admit(chat())
    await finish(engine, first.run.run_id, RunStatus.COMPLETED, result_text="old answer")
    again = await admitter.admit(chat())
    assert again.disposition is Disposition.RETRIED
    assert again.run.parent_run_id == first.run.run_id
    assert again.run.result_text is None
    # Its run.queued, read from its row (0048): why it was queued, by its lineage.
    async with engine.connect() as conn:
        queued = (
            await conn.execute(
                select(run_event_log.c.payload).where(
                    run_event_log.c.run_id == again.run.run_id, run_event_log.c.seq == 1
                )
            )
        ).scalar_one()
    assert queued == dict(run_queued(1, "redelivered").payload)


async def test_running_duplicate_attaches_without_a_new_owner(
    engine: AsyncEngine, admitter: Admitter
) -> None:
    await _tenant(engine, "t1")
    first = await admitter.admit(chat())
    async with engine.begin() as conn:
        await conn.execute(
            update(runs)
            .where(runs.c.run_id == first.run.run_id)
            .values(status="running", lease_owner="w1", lease_epoch=1)
        )
    again = await admitter.admit(chat())
    assert again.disposition is Disposition.ATTACHED
    assert again.run.run_id == first.run.run_id
    assert again.run.lease_owner == "w1"
    assert (await counts(engine))["runs"] == 1


async def test_concurrent_retries_of_a_failed_run_produce_one_new_run_with_lineage(
    engine: AsyncEngine, admitter: Admitter
) -> None:
    await _tenant(engine, "t1")
    first = await admitter.admit(chat())
    await finish(
        engine,
        first.run.run_id,
        RunStatus.FAILED,
        error={"code": "provider_overloaded", "message": "529", "retryable": True},
    )
    outcomes = await asyncio.gather(*(admitter.admit(chat()) for _ in range(20)))
    new_ids = {o.run.run_id for o in outcomes}
    assert len(new_ids) == 1, "competing retries must agree on exactly one new run"
    (new_id,) = new_ids
    assert new_id != first.run.run_id
    assert [o.disposition for o in outcomes].count(Disposition.RETRIED) == 1
    async with engine.connect() as conn:
        rows = {r.run_id: r for r in (await conn.execute(select(runs))).all()}
        claim = (await conn.execute(select(event_claims))).one()
    assert set(rows) == {first.run.run_id, new_id}
    assert rows[first.run.run_id].status == "failed", "the old run is kept for audit"
    assert rows[new_id].parent_run_id == first.run.run_id
    assert rows[new_id].root_run_id == first.run.run_id
    assert rows[new_id].status == "queued"
    assert claim.run_id == new_id
    assert claim.claimed_at > rows[first.run.run_id].created_at, "claim time refreshed"


async def test_non_retryable_failure_is_reported_not_rerun(
    engine: AsyncEngine, admitter: Admitter
) -> None:
    await _tenant(engine, "t1")
    first = await admitter.admit(chat())
    await finish(
        engine,
        first.run.run_id,
        RunStatus.FAILED,
        error={"code": "provider_bad_request", "message": "400", "retryable": False},
    )
    again = await admitter.admit(chat())
    assert again.disposition is Disposition.REPLAYED
    assert again.run.run_id == first.run.run_id
    assert (await counts(engine))["runs"] == 1


async def test_cancelled_run_is_retried_on_redelivery(
    engine: AsyncEngine, admitter: Admitter
) -> None:
    await _tenant(engine, "t1")
    first = await admitter.admit(chat())
    await finish(engine, first.run.run_id, RunStatus.CANCELLED)
    again = await admitter.admit(chat())
    assert again.disposition is Disposition.RETRIED
    assert again.run.parent_run_id == first.run.run_id


async def test_two_tenants_with_the_same_thread_never_share_a_session(
    engine: AsyncEngine, admitter: Admitter
) -> None:
    await _tenant(engine, "acme", "globex")
    a = await admitter.admit(messaging("message-104", "thread-example", tenant="acme"))
    b = await admitter.admit(messaging("message-104", "thread-example", tenant="globex"))
    assert a.disposition is Disposition.CREATED
    assert b.disposition is Disposition.CREATED, "the same provider id is a new event per tenant"
    assert a.run.session_id != b.run.session_id
    assert (a.run.tenant_id, b.run.tenant_id) == ("acme", "globex")


async def test_messages_of_one_thread_share_a_session_and_queue_behind_each_other(
    engine: AsyncEngine, admitter: Admitter
) -> None:
    await _tenant(engine, "acme")
    a = await admitter.admit(messaging("m-1", "thread-9", tenant="acme", text="hi"))
    b = await admitter.admit(messaging("m-2", "thread-9", tenant="acme", text="still there?"))
    assert a.run.session_id == b.run.session_id
    assert a.run.run_id != b.run.run_id
    assert (a.run.status, b.run.status) == ("queued", "queued")


async def test_two_principals_naming_the_same_thread_have_separate_sessions(
    engine: AsyncEngine, admitter: Admitter
) -> None:
    """A thread id is a correlation value: naming another principal's thread opens a new
    conversation instead of joining (and being authorised by) theirs."""
    await _tenant(engine, "acme")
    a = await admitter.admit(messaging("m-1", "thread-9", tenant="acme", principal="bridge-a"))
    b = await admitter.admit(messaging("m-2", "thread-9", tenant="acme", principal="bridge-b"))
    again = await admitter.admit(messaging("m-3", "thread-9", tenant="acme", principal="bridge-a"))
    assert a.run.session_id != b.run.session_id
    assert again.run.session_id == a.run.session_id, "the same principal stays in its thread"
    assert (b.run.status, b.run.session_head) == ("queued", True), "not queued behind a's run"


async def test_two_principals_reporting_the_same_task_have_separate_sessions(
    engine: AsyncEngine, admitter: Admitter
) -> None:
    await _tenant(engine, "acme")
    a = await admitter.admit(task_status("s-1", "T-9", principal="tracker-a"))
    b = await admitter.admit(task_status("s-2", "T-9", principal="tracker-b"))
    again = await admitter.admit(task_status("s-3", "T-9", principal="tracker-a"))
    assert a.run.session_id != b.run.session_id
    assert again.run.session_id == a.run.session_id, "the same principal stays in its task"
    async with engine.connect() as conn:
        assert (await conn.execute(select(func.count()).select_from(sessions))).scalar() == 2


async def test_two_principals_with_the_same_conversation_id_have_separate_sessions(
    engine: AsyncEngine, admitter: Admitter
) -> None:
    await _tenant(engine, "t1")
    a = await admitter.admit(chat("e-a", principal="alice", conversation="shared"))
    b = await admitter.admit(chat("e-b", principal="bob", conversation="shared"))
    assert a.run.session_id != b.run.session_id


async def test_same_text_with_a_new_event_id_is_a_new_message(
    engine: AsyncEngine, admitter: Admitter
) -> None:
    await _tenant(engine, "t1")
    first = await admitter.admit(chat("evt-monday", "yes"))
    second = await admitter.admit(chat("evt-next-week", "yes"))
    assert second.disposition is Disposition.CREATED
    assert first.run.run_id != second.run.run_id
