"""Retention against the real PostgreSQL: the orchestrator's sweep removes a terminal run past its
tenant's policy with everything of its aggregate and leaves a tombstone of its claim, admission's
removes the messages, sessions and tombstones that leaves; what is still needed stays (a run that
is not over, a run another retried, a live conversation's history). Time passes by moving the
rows' own times back, as the test's setup, never by sleeping."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import func, insert, literal, select, text, update
from sqlalchemy.ext.asyncio import AsyncEngine

from services.admission.domain import FreshnessPolicy
from services.admission.retention import Retention as AdmissionRetention
from services.admission.service import Admitter, Disposition
from services.orchestrator.knowledge import Knowledge
from services.orchestrator.repositories import retention as retention_repo
from services.orchestrator.repositories.fair_tags import STRIPES
from services.orchestrator.repositories.history import HISTORY_RUNS
from services.orchestrator.retention import Retention as RunRetention
from tests.integration.test_admission import chat
from tether import apikeys
from tether.db.engine import create_engine
from tether.db.schema import (
    attempts,
    audit_log,
    context_summaries,
    deliveries,
    documents,
    effects,
    event_claims,
    messages,
    run_events,
    run_parts,
    runs,
    sessions,
    tenant_queues,
    tenant_stripes,
    tenants,
    tool_outputs,
    usage_turns,
)
from tether.errors import FailedPrecondition, NotFound
from tether.settings import RetainingSettings
from tether.states import RunStatus
from tether.testing.eventually import eventually
from tether.visibility import Viewer

DAY = 86_400.0
# Short enough that moving a row's times back an hour expires it; long enough that nothing
# made during the test expires on its own.
POLICY = {"runs_s": 600, "tool_outputs_s": 300, "conversations_s": 600, "claims_s": DAY}
AGGREGATE = (
    run_events,
    run_parts,
    attempts,
    usage_turns,
    effects,
    tool_outputs,
    deliveries,
    audit_log,
)


@pytest.fixture
def admitter(engine: AsyncEngine) -> Admitter:
    return Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())


def sweeps(engine: AsyncEngine) -> tuple[RunRetention, AdmissionRetention]:
    """Both owners' sweeps; a pass that kept something starts again at once."""
    settings = RetainingSettings(retention_batch=100, retention_repass_s=1e-6)
    return RunRetention(engine, settings), AdmissionRetention(engine, settings)


async def sweep(engine: AsyncEngine) -> None:
    """One round of every sweep, the run aggregate's first (admission's follow from it)."""
    run_sweep, admission_sweep = sweeps(engine)
    await run_sweep.sweeps.round()
    await admission_sweep.sweeps.round()


async def tenant(engine: AsyncEngine, tenant_id: str = "t1", **policy: Any) -> None:
    async with engine.begin() as conn:
        await apikeys.ensure_tenant(conn, tenant_id)
        await conn.execute(
            update(tenants)
            .where(tenants.c.tenant_id == tenant_id)
            .values(policy={"retention": {**POLICY, **policy}})
        )


async def end(engine: AsyncEngine, run_ids: Sequence[str], status: RunStatus) -> None:
    """Test setup: end runs as the orchestrator would have (their session handed on)."""
    async with engine.begin() as conn:
        await conn.execute(
            update(runs)
            .where(runs.c.run_id.in_(run_ids))
            .values(status=status.value, finished_at=func.now(), session_head=False)
        )
        await conn.execute(
            update(sessions).where(sessions.c.active_run_id.in_(run_ids)).values(active_run_id=None)
        )


async def age(engine: AsyncEngine, hours: float, run_ids: Sequence[str] | None = None) -> None:
    """Test setup: move the times of runs (all when None), their messages and claims back."""
    back = timedelta(hours=hours)
    async with engine.begin() as conn:
        picked = runs.c.run_id.in_(run_ids) if run_ids is not None else text("true")
        await conn.execute(
            update(runs)
            .where(picked)
            .values(
                created_at=runs.c.created_at - back,
                finished_at=runs.c.finished_at - back,
            )
        )
        message_ids = select(runs.c.message_id).where(picked)
        await conn.execute(
            update(messages)
            .where(messages.c.message_id.in_(message_ids))
            .values(created_at=messages.c.created_at - back)
        )
        await conn.execute(
            update(event_claims)
            .where(event_claims.c.run_id.in_(select(runs.c.run_id).where(picked)))
            .values(claimed_at=event_claims.c.claimed_at - back)
        )


async def with_aggregate(engine: AsyncEngine, run_id: str) -> None:
    """Test setup: one row in each table of the run's aggregate."""
    async with engine.begin() as conn:
        await conn.execute(
            insert(run_parts).values(
                run_id=run_id,
                part_index=0,
                role="assistant",
                kind="text",
                payload={"text": "hi"},
                final=True,
                lease_epoch=1,
            )
        )
        await conn.execute(
            insert(attempts).values(run_id=run_id, lease_epoch=1, attempt=1, worker_id="w")
        )
        await conn.execute(
            insert(usage_turns).values(
                run_id=run_id,
                model="m",
                input_tokens=1,
                output_tokens=1,
                cache_creation_input_tokens=0,
                cache_read_input_tokens=0,
                cost_micros=1,
            )
        )
        await conn.execute(
            insert(effects).values(
                tenant_id="t1",
                key=f"fx-{run_id}",
                run_id=run_id,
                tool_name="publish_post",
                state="done",
            )
        )
        await conn.execute(
            insert(tool_outputs).values(output_ref=f"out-{run_id}", run_id=run_id, content="x")
        )
        await conn.execute(
            insert(deliveries).values(
                tenant_id="t1",
                delivery_id=f"dlv-{run_id}",
                run_id=run_id,
                channel_id="ch_1",
                kind="slack",
                state="sent",
                text="hi",
            )
        )
        await conn.execute(
            insert(audit_log).values(tenant_id="t1", run_id=run_id, action="run.completed")
        )


async def count(engine: AsyncEngine, table: Any, *where: Any) -> int:
    async with engine.connect() as conn:
        stmt = select(func.count()).select_from(table).where(*where)
        return int((await conn.execute(stmt)).scalar_one())


async def kept(engine: AsyncEngine, run_ids: Sequence[str]) -> set[str]:
    async with engine.connect() as conn:
        rows = await conn.execute(select(runs.c.run_id).where(runs.c.run_id.in_(run_ids)))
        return set(rows.scalars())


async def test_an_expired_run_goes_whole_and_its_claim_stays_as_a_tombstone(
    engine: AsyncEngine, admitter: Admitter
) -> None:
    await tenant(engine)
    run = (await admitter.admit(chat("evt-old", "hello"))).run
    await with_aggregate(engine, run.run_id)
    await end(engine, [run.run_id], RunStatus.COMPLETED)
    await age(engine, hours=1)
    await sweep(engine)
    assert not await kept(engine, [run.run_id])
    for table in (runs, *AGGREGATE):
        assert await count(engine, table, table.c.run_id == run.run_id) == 0, table.name
    async with engine.connect() as conn:
        claim = (await conn.execute(select(event_claims))).one()
    assert (claim.tenant_id, claim.scope, claim.key) == ("t1", "inbound", "chat:evt-old")
    assert claim.run_id is None and claim.request_hash == chat("evt-old", "hello").request_hash()
    # Admission's round followed: the message and the session it left empty went too.
    assert await count(engine, messages) == 0
    assert await count(engine, sessions) == 0


async def test_a_late_duplicate_of_an_expired_event_is_answered_and_never_runs_again(
    engine: AsyncEngine, admitter: Admitter
) -> None:
    await tenant(engine)
    run = (await admitter.admit(chat("evt-late", "hello"))).run
    await end(engine, [run.run_id], RunStatus.FAILED)  # a retryable failure: else re-claimed
    await age(engine, hours=1)
    await sweep(engine)
    assert not await kept(engine, [run.run_id])
    with pytest.raises(FailedPrecondition) as late:
        await admitter.admit(chat("evt-late", "hello"))
    assert late.value.code == "event_expired"
    assert "retention" in late.value.message
    assert await count(engine, runs) == 0
    # Other content under the key is the conflict it always was.
    with pytest.raises(Exception) as changed:
        await admitter.admit(chat("evt-late", "something else"))
    assert getattr(changed.value, "code", "") == "idempotency_conflict"
    assert await count(engine, runs) == 0


async def test_a_tombstone_goes_after_the_claims_policy(
    engine: AsyncEngine, admitter: Admitter
) -> None:
    await tenant(engine)
    run = (await admitter.admit(chat("evt-t", "hello"))).run
    await end(engine, [run.run_id], RunStatus.CANCELLED)
    await age(engine, hours=1)  # past runs_s (10 min), not claims_s (a day)
    await sweep(engine)
    assert await count(engine, event_claims, event_claims.c.run_id.is_(None)) == 1
    async with engine.begin() as conn:
        await conn.execute(
            update(event_claims).values(claimed_at=event_claims.c.claimed_at - timedelta(days=1))
        )
    await sweep(engine)
    assert await count(engine, event_claims) == 0


async def test_the_sweep_never_touches_a_run_that_is_not_over(
    engine: AsyncEngine, admitter: Admitter
) -> None:
    await tenant(engine)
    active = [s for s in RunStatus if not s.terminal]
    run_ids = []
    for i, status in enumerate(active):
        run = (await admitter.admit(chat(f"evt-{i}", "hi", conversation=f"c-{i}"))).run
        run_ids.append(run.run_id)
        # Adversarial: a finish time set as if over, long ago; only the status says it is not.
        async with engine.begin() as conn:
            await conn.execute(
                update(runs)
                .where(runs.c.run_id == run.run_id)
                .values(status=status.value, finished_at=func.now())
            )
        await with_aggregate(engine, run.run_id)
    await age(engine, hours=48)
    await sweep(engine)
    assert await kept(engine, run_ids) == set(run_ids)
    assert await count(engine, run_parts) == len(run_ids)
    assert await count(engine, messages) == len(run_ids)
    assert await count(engine, event_claims, event_claims.c.run_id.is_not(None)) == len(run_ids)


async def test_a_live_conversation_keeps_what_its_next_run_reads_and_a_quiet_one_goes(
    engine: AsyncEngine, admitter: Admitter
) -> None:
    await tenant(engine)
    live = [
        (await admitter.admit(chat(f"live-{i}", "hi", conversation="live"))).run.run_id
        for i in range(HISTORY_RUNS + 3)
    ]
    quiet = [
        (await admitter.admit(chat(f"quiet-{i}", "hi", conversation="quiet"))).run.run_id
        for i in range(3)
    ]
    await end(engine, live + quiet, RunStatus.COMPLETED)
    await age(engine, hours=1)
    # The live conversation had a message a moment ago (still queued).
    newest = (await admitter.admit(chat("live-new", "and now?", conversation="live"))).run
    await sweep(engine)
    # Its history stays: the last HISTORY_RUNS completed runs; the three before them go.
    assert await kept(engine, live) == set(live[3:])
    assert await kept(engine, [newest.run_id]) == {newest.run_id}
    # The quiet one went whole, with its session.
    assert not await kept(engine, quiet)
    async with engine.connect() as conn:
        left = set((await conn.execute(select(sessions.c.conversation_id))).scalars())
    assert left == {"live"}


async def test_a_retried_run_goes_after_the_run_that_retried_it(
    engine: AsyncEngine, admitter: Admitter
) -> None:
    await tenant(engine)
    first = (await admitter.admit(chat("evt-r", "hi"))).run
    await end(engine, [first.run_id], RunStatus.FAILED)
    retry = await admitter.admit(chat("evt-r", "hi"))
    assert retry.disposition is Disposition.RETRIED
    await end(engine, [retry.run.run_id], RunStatus.FAILED)
    await age(engine, hours=1)
    run_sweep, _ = sweeps(engine)
    await run_sweep.sweeps.round()
    # The retry went first (the first run is named as its parent until then)...
    assert await kept(engine, [first.run_id, retry.run.run_id]) == {first.run_id}
    await run_sweep.sweeps.round()
    # ...then the first, on the walk's next pass.
    assert not await kept(engine, [first.run_id])


async def test_whole_tool_outputs_go_sooner_and_the_run_stays(
    engine: AsyncEngine, admitter: Admitter
) -> None:
    await tenant(engine)
    run = (await admitter.admit(chat("evt-o", "hi"))).run
    await with_aggregate(engine, run.run_id)
    await end(engine, [run.run_id], RunStatus.COMPLETED)
    await age(engine, hours=0.1)  # 6 min: past tool_outputs_s (5 min), not runs_s (10 min)
    await sweep(engine)
    assert await count(engine, tool_outputs) == 0
    assert await kept(engine, [run.run_id]) == {run.run_id}
    assert await count(engine, run_parts) == 1


async def test_each_tenant_is_swept_under_its_own_policy(
    engine: AsyncEngine, admitter: Admitter
) -> None:
    await tenant(engine, "t1")
    await tenant(engine, "t2", runs_s=30 * DAY, claims_s=None)
    short = (await admitter.admit(chat("e", "hi", tenant="t1"))).run
    long = (await admitter.admit(chat("e", "hi", tenant="t2"))).run
    await end(engine, [short.run_id, long.run_id], RunStatus.FAILED)
    await age(engine, hours=24 * 10)
    await sweep(engine)
    assert await kept(engine, [short.run_id, long.run_id]) == {long.run_id}


async def test_a_retry_racing_the_removal_of_its_run_is_answered_never_an_error(
    engine: AsyncEngine, admitter: Admitter, db_url: str
) -> None:
    """The sweep holds the run it removes; a retry of it (by a redelivery or by its id) waits,
    then finds it gone: NotFound by id, the expired answer by redelivery, never a failure."""
    await tenant(engine)
    run = (await admitter.admit(chat("evt-race", "hi"))).run
    await end(engine, [run.run_id], RunStatus.FAILED)
    await age(engine, hours=1)
    sweeper = create_engine(db_url, pool_size=1)
    try:
        async with sweeper.begin() as conn:
            locked = await retention_repo.lock_expired_runs(conn, "t1", 600, None, 10)
            assert [r for _, r in locked] == [run.run_id]
            removed = await retention_repo.remove_expired_runs(conn, [run.run_id], 600, 600)
            assert removed == [run.run_id]
            by_id = asyncio.ensure_future(
                admitter.retry(Viewer("t1", "alice"), run.run_id, {"kind": "operator"})
            )
            redelivered = asyncio.ensure_future(admitter.admit(chat("evt-race", "hi")))
            await eventually(lambda: waiting_on_locks(engine, 2), timeout=10)
    finally:
        await sweeper.dispose()
    with pytest.raises(NotFound):
        await by_id
    with pytest.raises(FailedPrecondition) as late:
        await redelivered
    assert late.value.code == "event_expired"
    assert await count(engine, runs) == 0


async def waiting_on_locks(engine: AsyncEngine, n: int) -> bool:
    async with engine.connect() as conn:
        waiting = await conn.execute(
            text("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'")
        )
        return int(waiting.scalar_one()) >= n


async def test_a_deleted_tenants_rows_go_whatever_their_status_and_no_one_elses(
    engine: AsyncEngine, admitter: Admitter
) -> None:
    await tenant(engine, "t1")
    await tenant(engine, "t2")
    doomed = [(await admitter.admit(chat(f"e{i}", "hi", tenant="t1"))).run for i in range(3)]
    await end(engine, [doomed[0].run_id], RunStatus.FAILED)
    retried = await admitter.admit(chat("e0", "hi", tenant="t1"))  # a lineage of two
    await with_aggregate(engine, doomed[1].run_id)
    other = (await admitter.admit(chat("e0", "hi", tenant="t2"))).run
    # Its first run gave the tenant its finish tags and the row a claim locks under a cap.
    assert await count(engine, tenant_queues, tenant_queues.c.tenant_id == "t1") == 1
    assert await count(engine, tenant_stripes, tenant_stripes.c.tenant_id == "t1") == STRIPES
    run_sweep, admission_sweep = sweeps(engine)
    left = True
    while left:
        _, left = await run_sweep.delete_tenant("t1")
    left = True
    while left:
        _, left = await admission_sweep.delete_tenant("t1")
    ids = [r.run_id for r in doomed] + [retried.run.run_id]
    assert not await kept(engine, ids)
    for table in (runs, messages, sessions, event_claims, tenant_queues, tenant_stripes):
        assert await count(engine, table, table.c.tenant_id == "t1") == 0, table.name
    assert await kept(engine, [other.run_id]) == {other.run_id}
    assert await count(engine, messages, messages.c.tenant_id == "t2") == 1
    assert await count(engine, tenant_stripes, tenant_stripes.c.tenant_id == "t2") == STRIPES


async def test_a_live_conversation_keeps_its_summary_and_a_removed_summary_run_takes_it_along(
    engine: AsyncEngine, admitter: Admitter
) -> None:
    await tenant(engine)
    earlier = [
        (await admitter.admit(chat(f"s-{i}", "hi", conversation="s"))).run.run_id
        for i in range(HISTORY_RUNS + 3)
    ]
    holder = earlier[1]  # compacted runs 0: its summary is older than the history it keeps
    await with_aggregate(engine, holder)
    await end(engine, earlier, RunStatus.COMPLETED)
    async with engine.begin() as conn:
        await conn.execute(
            update(run_parts)
            .where(run_parts.c.run_id == holder)
            .values(kind="summary", payload={"text": "s", "throughRunId": earlier[0]})
        )
        await conn.execute(
            insert(context_summaries).from_select(
                ["session_id", "through_run_id", "through_created_at", "run_id", "part_index"],
                select(
                    runs.c.session_id, runs.c.run_id, runs.c.created_at, literal(holder), literal(0)
                ).where(runs.c.run_id == earlier[0]),
            )
        )
    await age(engine, hours=1)
    newest = (await admitter.admit(chat("s-new", "and now?", conversation="s"))).run
    await sweep(engine)
    # The history stays, and the run holding the summary the next run reads in place of the
    # runs it covers; the run it covers and the one after it go.
    assert await kept(engine, earlier) == {holder, *earlier[3:]}
    assert await count(engine, context_summaries) == 1
    # Once the conversation is quiet, everything goes, the summary with the run that held it.
    await end(engine, [newest.run_id], RunStatus.COMPLETED)
    await age(engine, hours=1)
    await sweep(engine)
    assert not await kept(engine, [*earlier, newest.run_id])
    assert await count(engine, context_summaries) == 0


async def test_a_deleted_tenants_documents_go_and_no_one_elses(engine: AsyncEngine) -> None:
    await tenant(engine, "t1")
    await tenant(engine, "t2")
    knowledge = Knowledge(engine)
    for i in range(3):
        await knowledge.add("t1", "alice", f"Doc {i}", "text")
    await knowledge.add("t2", "bob", "Theirs", "text")
    run_sweep = RunRetention(engine, RetainingSettings(retention_batch=2))
    rounds = 0
    left = True
    while left:
        _, left = await run_sweep.delete_tenant("t1")
        rounds += 1
    assert rounds == 2, "a batch at a time"
    assert await count(engine, documents, documents.c.tenant_id == "t1") == 0
    assert await count(engine, documents, documents.c.tenant_id == "t2") == 1
