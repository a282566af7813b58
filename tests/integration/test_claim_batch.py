"""A claim of up to n runs against the real PostgreSQL: one statement leases them all (oldest
session heads first), with each run's run.started as its constructor builds it, its attempt and
its routing; one more statement reads the history and parts of those that have any, and a
tenant whose routing is not known here yet costs one more claim statement, once."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import select, text, update
from sqlalchemy.ext.asyncio import AsyncEngine

from services.admission.domain import FreshnessPolicy
from services.admission.service import Admitter
from services.orchestrator.claim_planner import CLAIM_PLANNER
from services.orchestrator.execution import Execution
from services.orchestrator.repositories import history
from services.orchestrator.repositories import runs as runs_repo
from tests.integration.search_plans import finished_history, generic_plan
from tests.integration.statements import counting
from tests.integration.test_admission import _tenant, chat, messaging
from tether.db.engine import create_engine
from tether.db.schema import attempts, run_event_log, run_events, runs, tenants
from tether.domain import (
    Batch,
    Completed,
    Completion,
    ModelTurn,
    Part,
    Role,
    Summary,
    Text,
    context_compacted,
    part_added,
    run_started,
)
from tether.errors import FailedPrecondition, InvalidArgument, StaleLease

pytestmark = pytest.mark.asyncio(loop_scope="session")


def _execution(engine: AsyncEngine) -> Execution:
    return Execution.build(engine, None, lease_ttl_s=30, claim_poll_s=60)


async def _admit(engine: AsyncEngine, count: int, *, prefix: str = "e") -> list[str]:
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    return [
        (await admitter.admit(chat(f"{prefix}{i}", conversation=f"{prefix}-c{i}"))).run.run_id
        for i in range(count)
    ]


async def _first_turn_answered(
    execution: Execution, admitter: Admitter, conversation: str
) -> tuple[str, Part]:
    """A conversation's first message ("first"), leased and completed with one answer part:
    its run id and that part."""
    event = chat(f"{conversation}1", "first", conversation=conversation)
    done_id = (await admitter.admit(event)).run.run_id
    [done] = await execution.claims.claim_many("w", 1)
    answer = Part(0, Role.ASSISTANT, Text("the first answer"), final=True)
    await execution.attempts.complete(
        done_id, done.run.lease_epoch, Completion(Completed("the first answer"), parts=[answer])
    )
    return done_id, answer


async def _rows(engine: AsyncEngine, stmt: Any) -> list[Any]:
    async with engine.connect() as conn:
        return list((await conn.execute(stmt)).all())


async def test_a_claim_of_eight_runs_is_one_statement_and_leases_the_oldest_first(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "t1")
    execution = _execution(engine)
    admitted = await _admit(engine, 10)

    with counting(engine) as cold:
        [first] = await execution.claims.claim_many("w-0", 1)
    # Routing for t1 is not known here yet: the first look returns its agent to resolve.
    assert (len(cold.statements), cold.total) == (2, 2), cold
    assert first.run.run_id == admitted[0]

    with counting(engine) as one:
        [second] = await execution.claims.claim_many("w-1", 1)
    assert (len(one.statements), one.total) == (1, 1), one
    assert second.run.run_id == admitted[1]

    with counting(engine) as eight:
        claimed = await execution.claims.claim_many("w-8", 8)
    assert (len(eight.statements), eight.total) == (1, 1), eight
    assert [c.run.run_id for c in claimed] == admitted[2:10]
    with counting(engine) as none:
        assert await execution.claims.claim_many("w-8", 8) == []  # the queue is empty
        assert await execution.claims.claim_many("w-8", 0) == []
    assert len(none.statements) == 1, "a claim of nothing sends nothing"

    for c in claimed:
        assert (c.run.status, c.run.lease_owner, c.run.lease_epoch) == ("running", "w-8", 1)
        assert await _routing(engine, c.run.run_id) == c.config.to_json()
        assert c.earlier == [] and c.own == []
        # The event each run's lease returned is the one stored, as its constructor builds it.
        [event] = c.lease.events
        assert (event.seq, event.event) == (2, run_started(1, "w-8", 1))
    stored = await _rows(
        engine,
        select(
            run_event_log.c.run_id,
            run_event_log.c.seq,
            run_event_log.c.type,
            run_event_log.c.payload,
        )
        .where(run_event_log.c.type == "run.started")
        .order_by(run_event_log.c.run_id),
    )
    expected = {c.run.run_id: run_started(1, "w-8", 1) for c in claimed}
    for row in stored:
        if row.run_id in expected:
            assert (row.seq, row.type) == (2, "run.started")
            assert row.payload == dict(expected[row.run_id].payload)
    assert sorted(r.run_id for r in stored if r.run_id in expected) == sorted(expected)
    recorded = await _rows(engine, select(attempts).where(attempts.c.worker_id == "w-8"))
    assert sorted(r.run_id for r in recorded) == sorted(expected)
    assert {(r.lease_epoch, r.attempt) for r in recorded} == {(1, 1)}
    assert all(set(r.stages) == {"routing_ms"} for r in recorded)
    # Each run.started is read from its attempt's record (at the seq it holds), never stored
    # as an event row of its own as well (0048).
    assert {r.event_seq for r in recorded} == {2}
    rows = await _rows(
        engine,
        select(run_events.c.run_id).where(
            run_events.c.run_id.in_(list(expected)), run_events.c.type == "run.started"
        ),
    )
    assert rows == []


async def test_history_and_own_parts_are_one_more_statement_for_the_whole_batch(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "t1")
    execution = _execution(engine)
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    # Conversation "h": a completed run, then a second message with that history.
    done_id, answer = await _first_turn_answered(execution, admitter, "h")
    # Conversation "p": a run that wrote a part, then went back to the queue.
    parted_id = (await admitter.admit(chat("p1", conversation="p"))).run.run_id
    [parted] = await execution.claims.claim_many("w", 1)
    assert parted.run.run_id == parted_id
    draft = Part(0, Role.ASSISTANT, Text("half an answer"), final=True)
    await execution.attempts.checkpoint(parted_id, parted.run.lease_epoch, Batch(1, [draft]))
    assert await execution.attempts.release(parted_id, parted.run.lease_epoch)
    later_id = (await admitter.admit(chat("h2", "second", conversation="h"))).run.run_id
    fresh = await _admit(engine, 3, prefix="f")

    with counting(engine) as sent:
        claimed = {c.run.run_id: c for c in await execution.claims.claim_many("w", 8)}
    # The claim, then the batch's history and own parts, then (one run here was leased before)
    # the wall clock the batch's re-leased runs have used: each one statement for the batch.
    assert (len(sent.statements), sent.total) == (3, 3), sent
    assert set(claimed) == {later_id, parted_id, *fresh}
    [earlier] = claimed[later_id].earlier
    assert (earlier.run_id, earlier.input_text, earlier.parts) == (done_id, "first", [answer])
    assert claimed[later_id].own == []
    # Its own parts come flagged: the released attempt's turn was superseded.
    assert claimed[parted_id].earlier == []
    assert claimed[parted_id].own == [replace(draft, superseded=True)]
    assert all(claimed[f].earlier == [] and claimed[f].own == [] for f in fresh)


def _but_the_clock(config: dict[str, Any]) -> dict[str, Any]:
    """A configuration without its wall-clock limit (lowered for a run leased before)."""
    limits = {k: v for k, v in config["limits"].items() if k != "wall_clock_seconds"}
    return {**config, "limits": limits}


async def _routing(engine: AsyncEngine, run_id: str) -> dict[str, Any]:
    """The routing decision pinned on the run (named on its row, stored once in routings)."""
    async with engine.connect() as conn:
        return await runs_repo.routing_of(conn, run_id)


async def test_a_changed_agent_is_leased_with_its_new_routing_at_the_next_claim(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "t1")
    execution = _execution(engine)
    first, second = await _admit(engine, 2)
    [claimed] = await execution.claims.claim_many("w", 1)
    assert claimed.run.run_id == first and claimed.config.model == "claude-sonnet-5-5"
    async with engine.begin() as conn:
        await conn.execute(
            update(tenants).where(tenants.c.tenant_id == "t1").values(agent={"model": "m-2"})
        )
    with counting(engine) as sent:
        [claimed] = await execution.claims.claim_many("w", 1)
    assert len(sent.statements) == 2, "the changed agent came back once, to be resolved"
    assert claimed.run.run_id == second and claimed.config.model == "m-2"
    assert (await _routing(engine, second))["model"] == "m-2"


async def test_a_tenant_whose_routing_is_broken_has_its_runs_failed_not_leased(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "t1")
    async with engine.begin() as conn:
        await conn.execute(
            text('UPDATE tenants SET agent = \'{"limits": {"no_such_limit": 1}}\'::jsonb')
        )
    execution = _execution(engine)
    [run_id] = await _admit(engine, 1)
    assert await execution.claims.claim_many("w", 4) == []
    [row] = await _rows(engine, select(runs.c.status, runs.c.error).where(runs.c.run_id == run_id))
    assert row.status == "failed" and row.error["code"] == "routing_failed"


async def test_a_run_keeps_the_routing_it_started_with_and_routing_follows_its_origin(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "t1")
    concierge = {
        "name": "concierge",
        "version": 1,
        "instructions": "You look after guests.",
        "channels": ["whatsapp"],
    }
    async with engine.begin() as conn:
        agent = {"personas": [concierge]}
        await conn.execute(update(tenants).where(tenants.c.tenant_id == "t1").values(agent=agent))
    execution = _execution(engine)
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    chat_run = (await admitter.admit(chat("pin-1", conversation="pin"))).run.run_id
    guest_run = (await admitter.admit(messaging("pin-2", "thread-1", tenant="t1"))).run.run_id
    first = {c.run.run_id: c for c in await execution.claims.claim_many("w", 2)}
    assert first[chat_run].config.persona is not None
    assert first[chat_run].config.persona.name == "tether-demo"
    assert first[chat_run].origin.source == "chat"
    guest = first[guest_run]
    assert guest.config.persona is not None and guest.config.persona.ref == "concierge@1"
    assert (guest.origin.source, guest.origin.channel) == ("messaging", "whatsapp")
    assert (guest.origin.actor_type, guest.origin.actor_id) == ("guest", "guest-1")
    pinned = await _routing(engine, chat_run)
    assert await execution.attempts.release(chat_run, first[chat_run].run.lease_epoch)

    # The tenant changes its agent while the run waits: the run resumes with what it started
    # with, a new run gets the new one.
    changed = {"model": "m-2", "persona": {**concierge, "name": "newer", "channels": []}}
    async with engine.begin() as conn:
        await conn.execute(update(tenants).where(tenants.c.tenant_id == "t1").values(agent=changed))
    fresh_run = (await admitter.admit(chat("pin-3", conversation="pin-new"))).run.run_id
    again = {c.run.run_id: c for c in await execution.claims.claim_many("w", 2)}
    assert set(again) == {chat_run, fresh_run}
    # Its pinned configuration, but for the wall clock its first attempt used (run-level
    # deadline: limits.wall_clock_seconds counts from the run's first start).
    resumed = again[chat_run].config.to_json()
    assert 0 < resumed["limits"]["wall_clock_seconds"] < pinned["limits"]["wall_clock_seconds"]
    assert _but_the_clock(resumed) == _but_the_clock(pinned)
    assert again[chat_run].run.routing_id == first[chat_run].run.routing_id
    assert again[fresh_run].config.model == "m-2"
    assert again[fresh_run].config.persona is not None
    assert again[fresh_run].config.persona.ref == "newer@1"

    # Another replica that never routed the run reads the pinned decision back.
    other = _execution(engine)
    assert await execution.attempts.release(chat_run, again[chat_run].run.lease_epoch)
    [third] = await other.claims.claim_many("w2", 1)
    assert third.run.run_id == chat_run
    assert _but_the_clock(third.config.to_json()) == _but_the_clock(pinned)


async def test_a_summary_is_stored_once_per_range_and_stands_in_for_the_runs_it_covers(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "t1")
    execution = _execution(engine)
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    done = []
    for i in range(3):
        run_id = (await admitter.admit(chat(f"s{i}", f"question {i}", conversation="s"))).run.run_id
        [leased] = await execution.claims.claim_many("w", 1)
        answer = Part(0, Role.ASSISTANT, Text(f"answer {i}"), final=True)
        turn = ModelTurn("claude-sonnet-5-5", 100 * (i + 1), 10)
        await execution.attempts.complete(
            run_id,
            leased.run.lease_epoch,
            Completion(Completed(f"answer {i}"), parts=[answer], turns=[turn]),
        )
        done.append(run_id)
    current = (await admitter.admit(chat("s3", "question 3", conversation="s"))).run.run_id
    [leased] = await execution.claims.claim_many("w", 1)
    assert [e.run_id for e in leased.earlier] == done and leased.summary is None
    assert leased.last_turn == history.LastTurn(300 + 10, own=False)

    summary = Summary("questions 0 and 1 were answered", done[0], done[1], runs=2, parts=4)
    part = Part(0, Role.ASSISTANT, summary, final=True)
    events = [part_added(part), context_compacted(0, summary)]
    epoch = leased.run.lease_epoch
    await execution.attempts.store_summary(current, epoch, part, events)
    before = await _rows(
        engine, select(run_event_log.c.seq).where(run_event_log.c.run_id == current)
    )
    again = Part(1, Role.ASSISTANT, summary, final=True)
    with pytest.raises(FailedPrecondition) as twice:
        await execution.attempts.store_summary(current, epoch, again, [part_added(again)])
    assert twice.value.code == "summary_exists"
    after = await _rows(
        engine, select(run_event_log.c.seq).where(run_event_log.c.run_id == current)
    )
    assert after == before, "a second summary of the range writes nothing"
    foreign = Summary("elsewhere", "run_x", "run_x")
    with pytest.raises(InvalidArgument):
        await execution.attempts.store_summary(
            current, epoch, Part(1, Role.ASSISTANT, foreign, final=True), []
        )
    with pytest.raises(StaleLease):
        await execution.attempts.store_summary(current, epoch + 1, again, [])

    # A later attempt of the run, and the runs after it, start from the summary.
    assert await execution.attempts.release(current, epoch)
    [resumed] = await execution.claims.claim_many("w", 1)
    assert resumed.summary == part
    assert [e.run_id for e in resumed.earlier] == [done[2]]
    assert resumed.own == [part]
    assert resumed.last_turn == history.NO_TURN, "the turns before the summary are stale"
    turn = ModelTurn("claude-sonnet-5-5", 50, 5)
    answer = Part(1, Role.ASSISTANT, Text("answer 3"), final=True)
    await execution.attempts.complete(
        current,
        resumed.run.lease_epoch,
        Completion(Completed("answer 3"), parts=[answer], turns=[turn]),
    )
    await admitter.admit(chat("s4", "question 4", conversation="s"))
    [later] = await execution.claims.claim_many("w", 1)
    assert later.summary == part
    assert [e.run_id for e in later.earlier] == [done[2], current]
    assert later.last_turn == history.LastTurn(55, own=False)


async def test_the_history_statement_is_planned_once_per_connection_not_per_lease(
    engine: AsyncEngine,
) -> None:
    # Planning the history statement costs more than running it (issue 34's lease cost), so
    # its plan must not depend on the values bound: PostgreSQL then keeps a generic plan after
    # its fifth custom one, on each connection, and reads every later lease's history with it.
    await _tenant(engine, "t1")
    execution = _execution(engine)
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    done_id, _ = await _first_turn_answered(execution, admitter, "g")
    later = await admitter.admit(chat("g2", "second", conversation="g"))
    [done_row] = await _rows(engine, select(runs.c.created_at).where(runs.c.run_id == done_id))
    [later_row] = await _rows(engine, select(runs).where(runs.c.run_id == later.run.run_id))
    autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
    async with autocommit.connect() as conn:
        # With statistics, as a live database has them: a value bound where the plan could
        # have taken a constant (a status, a LIMIT) is then estimated differently.
        await conn.execute(text("ANALYZE runs, run_parts, usage_turns, context_summaries"))
        for i in range(12):
            # Values that differ from lease to lease: a worker that holds the run before, one
            # that holds nothing; with its own parts asked for or not.
            held = done_row.created_at if i % 2 else None
            own = bool(i % 3)
            wanted = history.Wanted(
                later_row.run_id, later_row.session_id, later_row.created_at, True, own, held
            )
            found = await history.attempt_inputs(conn, [wanted], limit_runs=50)
            earlier = found[later_row.run_id].earlier
            assert [e.run_id for e in earlier] == ([] if held else [done_id])
        planned = (
            await conn.execute(
                text(
                    "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
                    "WHERE statement LIKE '%AS wanted%' AND statement LIKE '%row_kind%' "
                    "AND statement NOT LIKE '%pg_prepared_statements%'"
                )
            )
        ).all()
    # Nothing but the wanted runs is bound: no value for the plan to be estimated by.
    assert set(history._INPUTS.statement.compile(dialect=engine.dialect).binds) == {"wanted"}
    assert planned, "the statement is prepared on the connection"
    [(generic, custom)] = planned
    assert custom <= 5 and generic == 12 - custom, planned


async def test_the_history_is_read_by_key_alone_on_the_claims_plan(engine: AsyncEngine) -> None:
    """The claims' pool reads the history too, planned as the claim is (CLAIM_PLANNER: one
    generic plan a connection, made on whatever the tables hold then, with no bitmap or
    sequential scans): each of its reads is a probe by key, none a hash of a table's rows,
    however few a fresh database has (the summary's part, the last turn of two runs)."""
    await finished_history(engine)
    sql = str(history._INPUTS.statement.compile(dialect=engine.dialect))
    plan = await generic_plan(engine, sql, 1, CLAIM_PLANNER)
    for table in ("runs", "run_keys", "run_parts", "usage_turns", "context_summaries"):
        assert f"Seq Scan on {table}" not in plan, plan
    assert "Hash" not in plan, plan
    assert "Index Scan using ix_usage_turns_run" in plan, plan


async def test_a_replica_without_a_claims_pool_claims_with_one_connection(db_url: str) -> None:
    """Without a claims' pool of its own, the claim and the history read after it run on the
    connection the claim holds: never a second one of the same pool, which a pool of one
    connection (no overflow) would wait for forever."""
    one = create_engine(db_url, pool_size=1)
    try:
        await _tenant(one, "t1")
        execution = _execution(one)
        admitter = Admitter(one, max_attempts=3, freshness=FreshnessPolicy())
        done_id, answer = await _first_turn_answered(execution, admitter, "one")
        await admitter.admit(chat("one2", "second", conversation="one"))
        [claimed] = await asyncio.wait_for(execution.claims.claim_many("w", 1), timeout=10)
    finally:
        await one.dispose()
    assert [run.run_id for run in claimed.earlier] == [done_id]
    assert claimed.earlier[0].parts[-1] == answer
