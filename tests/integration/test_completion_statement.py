"""A run's completion against the real PostgreSQL: one statement (the lease fence and the
completion function), writing exactly what the aggregate's statements it was built from write
when run one by one; a batch that landed lands once, a cancel accepted first still wins, a stale
lease writes nothing; and a one-turn run costs three statements from admission to its end."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import redis.asyncio as redis
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from services.admission.domain import FreshnessPolicy
from services.admission.service import Admitter
from services.orchestrator.claims import Claimed
from services.orchestrator.execution import Execution
from services.orchestrator.repositories import runs as runs_repo
from services.orchestrator.repositories import webhook_dispatch
from tests.integration.statements import counting
from tests.integration.test_admission import _tenant, chat
from tether import formats
from tether.bus import Bus
from tether.db.schema import (
    attempts,
    audit_log,
    run_event_log,
    run_events,
    run_parts,
    runs,
    sessions,
    usage_turns,
)
from tether.domain import (
    Batch,
    Completed,
    Completion,
    Failed,
    LoggedEvent,
    ModelTurn,
    Part,
    Role,
    RunError,
    Text,
    ToolCall,
    ToolResult,
    part_added,
    run_completed,
    tool_completed,
    tool_started,
    usage_updated,
)
from tether.errors import StaleLease
from tether.hints import decode_events, events_channel
from tether.pricing import TOKEN_FIELDS, cost_micros

pytestmark = pytest.mark.asyncio(loop_scope="session")

MODEL = "claude-sonnet-5-5"  # the default routing's model, priced by it


def _execution(engine: AsyncEngine, stored_format: int = formats.NEWEST) -> Execution:
    return Execution.build(
        engine, None, lease_ttl_s=30, claim_poll_s=60, stored_format=stored_format
    )


def _answer(text: str = "the answer") -> Completion:
    return Completion(
        Completed(text),
        parts=[Part(0, Role.ASSISTANT, Text(text), final=True)],
        turns=[ModelTurn(MODEL, 120, 30)],
        stages={"context_ms": 1.5, "attempt_ms": 20.0, "total_ms": 25.0},
        audit={"model": MODEL},
    )


TOOL_TURN = ModelTurn(MODEL, 100, 20, cache_read_input_tokens=7)


def _tool_turn_then_answer(cost_micros: int = 0) -> Completion:
    """A completion carrying its in-flight tool turn (a call and its result, their events and
    the turn's usage, priced at `cost_micros`), then the answer, with warnings and an event of
    its own."""
    call = Part(0, Role.ASSISTANT, ToolCall("toolu_1", "get_time", {}), final=True)
    result = Part(1, Role.TOOL, ToolResult("toolu_1", "noon"), final=True)
    turn = replace(TOOL_TURN, cost_micros=cost_micros)
    flight = Batch(
        1,
        [call, result],
        [
            part_added(call),
            tool_started("toolu_1", "get_time"),
            tool_completed("toolu_1", "get_time"),
            usage_updated(turn, turn.tokens()),
        ],
        [turn],
    )
    answer = Part(2, Role.ASSISTANT, Text("It is noon."), final=True)
    return Completion(
        Completed("It is noon.", "resolved", ("max_steps_near",)),
        parts=[answer],
        events=[part_added(answer)],
        turns=[ModelTurn(MODEL, 140, 12)],
        stages={"routing_ms": 9.0, "attempt_ms": 30.0},
        audit={"model": MODEL, "steps": 2},
        in_flight=flight,
    )


async def _rows(engine: AsyncEngine, stmt: Any) -> list[Any]:
    async with engine.connect() as conn:
        return list((await conn.execute(stmt)).all())


async def _stored(engine: AsyncEngine, run_id: str) -> dict[str, Any]:
    """What a run's ending left in every table it writes, without ids and times."""
    [run] = await _rows(engine, select(runs).where(runs.c.run_id == run_id))
    [session] = await _rows(engine, select(sessions).where(sessions.c.session_id == run.session_id))
    return {
        "run": {
            k: run._mapping[k]
            for k in (
                "status",
                "result_text",
                "format",
                "task_outcome",
                "warnings",
                "error",
                "usage",
                "last_seq",
                "lease_owner",
                "lease_expires_at",
                "lease_epoch",
            )
        },
        "finished": run.finished_at is not None,
        "events": [
            (e.seq, e.type, e.payload, e.format)
            for e in await _rows(
                engine,
                select(run_event_log)
                .where(run_event_log.c.run_id == run_id)
                .order_by(run_event_log.c.seq),
            )
        ],
        # The log's own rows: one an event, or one of the events a write appended together.
        "rows": [
            (e.seq, e.type, e.format)
            for e in await _rows(
                engine,
                select(run_events).where(run_events.c.run_id == run_id).order_by(run_events.c.seq),
            )
        ],
        "parts": [
            (p.part_index, p.role, p.kind, p.payload, p.final, p.lease_epoch, p.format)
            for p in await _rows(
                engine,
                select(run_parts)
                .where(run_parts.c.run_id == run_id)
                .order_by(run_parts.c.part_index),
            )
        ],
        "turns": [
            (t.model, *[t._mapping[k] for k in (*TOKEN_FIELDS, "cost_micros")], t.event_seq)
            for t in await _rows(
                engine,
                select(usage_turns)
                .where(usage_turns.c.run_id == run_id)
                .order_by(usage_turns.c.id),
            )
        ],
        "attempts": [
            (
                a.lease_epoch,
                a.outcome,
                a.error,
                {k: v for k, v in a.stages.items() if k != "routing_ms"},
                a.detail,
            )
            for a in await _rows(engine, select(attempts).where(attempts.c.run_id == run_id))
        ],
        "audit": [
            (a.action, a.detail)
            for a in await _rows(engine, select(audit_log).where(audit_log.c.run_id == run_id))
        ],
        "session_has_a_head": session.active_run_id is not None,
    }


async def _claim(execution: Execution, count: int = 1) -> list[Claimed]:
    claimed = await execution.claims.claim_many("w", count)
    assert len(claimed) == count
    return claimed


async def test_a_completion_is_one_statement(engine: AsyncEngine) -> None:
    await _tenant(engine, "t1")
    execution = _execution(engine)
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    for i in range(2):
        await admitter.admit(chat(f"e{i}", conversation=f"c{i}"))
    plain, flying = await _claim(execution, 2)
    with counting(engine) as sent:
        row = await execution.attempts.complete(plain.run.run_id, 1, _answer())
    assert (len(sent.statements), sent.total) == (1, 1), sent
    assert row.status == "completed" and row.result_text == "the answer"
    with counting(engine) as sent:
        await execution.attempts.complete(flying.run.run_id, 1, _tool_turn_then_answer())
    assert (len(sent.statements), sent.total) == (1, 1), sent


async def test_a_one_turn_run_costs_three_statements_from_admission_to_its_end(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "t1")
    execution = _execution(engine)
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    await admitter.admit(chat("warm", conversation="warm"))  # routing resolved once, here
    await _claim(execution)
    with counting(engine) as sent:
        run_id = (await admitter.admit(chat("e1", conversation="c1"))).run.run_id
        [claimed] = await _claim(execution)
        await execution.attempts.complete(run_id, claimed.run.lease_epoch, _answer())
    assert claimed.run.run_id == run_id
    assert (len(sent.statements), sent.total) == (3, 3), sent


async def test_the_function_writes_what_the_statements_it_is_built_from_write(
    engine: AsyncEngine,
) -> None:
    """Twin runs, each with a next message queued in its conversation, end with the same
    completion: one through the function, one through the aggregate's statements one by one
    (the path a completion takes when a cancel came first), both storing run.completed whole
    (format 2, as a release before this one does, and reads)."""
    await _tenant(engine, "t1")
    execution = _execution(engine, stored_format=formats.CURRENT)
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    for twin in ("a", "b"):
        await admitter.admit(chat(f"{twin}1", "what time is it", conversation=twin))
    at_once, one_by_one = await _claim(execution, 2)
    nexts = [
        (await admitter.admit(chat(f"{twin}2", conversation=twin))).run.run_id
        for twin in ("a", "b")
    ]

    for claimed, write in (
        (at_once, execution.attempts.complete),
        (one_by_one, execution.attempts._end),
    ):
        done = _tool_turn_then_answer()
        row = await write(claimed.run.run_id, 1, done)
        assert row.status == "completed"
    function, statements = [await _stored(engine, c.run.run_id) for c in (at_once, one_by_one)]
    assert function == statements
    # The run.completed stored is the one its constructor builds from the stored usage.
    [*_, (_, kind, payload, format)] = function["events"]
    done = _tool_turn_then_answer()
    assert isinstance(done.ending, Completed)
    assert (kind, payload, format) == (
        "run.completed",
        run_completed(done.ending, function["run"]["usage"]).payload,
        formats.CURRENT,
    )
    assert function["run"]["usage"]["cache_read_input_tokens"] == 7
    # Stored without the fields that are 0 (a reader takes one left out as 0).
    assert "cache_creation_input_tokens" not in function["run"]["usage"]
    # Each session was handed to its next message, which may now be claimed.
    handed = {c.run.run_id for c in await execution.claims.claim_many("w", 4)}
    assert handed == set(nexts)


async def test_a_completion_is_recorded_on_its_attempt_and_not_in_the_audit_log(
    engine: AsyncEngine,
) -> None:
    """The audit information of a completion is its attempt's own record: what the worker
    reported, the usage, the warnings, on the attempts row it closes; audit_log keeps the acts
    of people and the operator."""
    await _tenant(engine, "t1")
    execution = _execution(engine)
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    await admitter.admit(chat("e1", conversation="c1"))
    [claimed] = await _claim(execution)
    await execution.attempts.complete(claimed.run.run_id, 1, _tool_turn_then_answer())
    stored = await _stored(engine, claimed.run.run_id)
    assert stored["audit"] == []
    [(epoch, outcome, _, _, detail)] = stored["attempts"]
    assert (epoch, outcome) == (1, "completed")
    assert detail == {
        "model": MODEL,
        "steps": 2,
        "usage": stored["run"]["usage"],
        "warnings": ["max_steps_near"],
    }


@pytest.mark.parametrize("ending", [None, Failed(RunError("provider_error", "gone"))])
async def test_an_ending_goes_out_as_one_message(
    engine: AsyncEngine, redis_url: str, ending: Failed | None
) -> None:
    """A completion publishes what it stored: the events one commit stored (the in-flight
    batch's and the ending's) reach the run's channel together, in one message on real Redis,
    as the hints' format says: an answer (one statement) and a failure (a transaction of a
    few)."""
    await _tenant(engine, "t1")
    bus = Bus(redis_url)
    execution = Execution.build(engine, bus, lease_ttl_s=30, claim_poll_s=60)
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    run_id = (await admitter.admit(chat("e1", conversation="c1"))).run.run_id
    await _claim(execution)
    await bus.flush()  # run.started, published by the claim, went out before we listen
    listener = redis.Redis.from_url(redis_url)
    channel = listener.pubsub()
    try:
        await channel.subscribe(events_channel(run_id))
        done = _tool_turn_then_answer()
        await execution.attempts.complete(
            run_id, 1, done if ending is None else replace(done, ending=ending)
        )
        bus.post(events_channel(run_id), "end")  # Redis keeps one connection's order
        messages = []
        async for message in channel.listen():
            if message["type"] != "message":
                continue
            if message["data"] == b"end":
                break
            decoded = decode_events(message["data"])
            messages.append([(m.seq, m.type, dict(m.payload)) for m in decoded])
    finally:
        await channel.aclose()
        await listener.aclose()
        await bus.close()
    read = await _read_back(engine, run_id)
    assert messages == [[(e.seq, e.type, dict(e.payload)) for e in read[2:]]]


def _recording(execution: Execution) -> list[Any]:
    """What `execution` publishes from now on: (seq, type, payload) of each event."""
    published: list[Any] = []

    async def publish(run: Any, events: Any, *, delivered: bool = False) -> None:
        published.extend((e.seq, str(e.event.type), dict(e.event.payload)) for e in events)

    execution.publisher.publish = publish  # type: ignore[method-assign]
    return published


async def _read_back(engine: AsyncEngine, run_id: str) -> list[LoggedEvent]:
    """The run's events as the orchestrator's readers take them (`formats.fill`)."""
    async with engine.connect() as conn:
        stored = await runs_repo.read_events(conn, run_id, 0, 100)
        run = await runs_repo.get_run(conn, "t1", run_id)
        return await runs_repo.filled_events(
            conn, run_id, stored, result_text=run.result_text, usage=run.usage
        )


async def _priced(engine: AsyncEngine, run_id: str, turn: ModelTurn) -> int:
    """`turn`'s cost at the prices the run was routed with, as its worker prices it."""
    async with engine.connect() as conn:
        prices = await runs_repo.routed_prices(conn, run_id)
    return cost_micros(turn.tokens(), prices.get(turn.model))


async def test_a_completion_stores_each_record_once(engine: AsyncEngine) -> None:
    """Stored by reference (format 3): run.completed without the answer and the usage total,
    which the run keeps, and each part.added of a final part as its index, whose row holds it;
    (format 4) usage.updated without its turn, whose row names the event; every other event
    whole, as format 2; (format 5) the answer as its parts alone (`runs.result_text` NULL, the
    row's format 5); (format 6) the completion's events, with those of the batch in flight, in
    one row. Read back, each is what was published, whole, and the run shows its answer. While
    the release before this one runs (format 5), each event is a row of its own; while the one
    before that runs (format 4), the answer is stored whole; before that (3), usage.updated is
    too; before that (2), every event."""
    await _tenant(engine, "t1")
    for stored_format in (
        formats.NEWEST,
        formats.ANSWER_BY_REFERENCE,
        formats.USAGE_BY_REFERENCE,
        formats.BY_REFERENCE,
        formats.CURRENT,
    ):
        execution = _execution(engine, stored_format)
        admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
        conversation = f"c{stored_format}"
        await admitter.admit(chat(f"e{stored_format}", conversation=conversation))
        [claimed] = await _claim(execution)
        published = _recording(execution)
        cost = await _priced(engine, claimed.run.run_id, TOOL_TURN)
        assert cost > 0
        run = await execution.attempts.complete(claimed.run.run_id, 1, _tool_turn_then_answer(cost))
        rows = await _stored(engine, run.run_id)
        stored = rows["events"][2:]
        # The in-flight turn names its usage.updated; the completion's own turn came without one.
        assert [t[-1] for t in rows["turns"]] == [published[3][0], None]
        usage = published[3][2]
        if stored_format >= formats.BY_REFERENCE:
            assert [(kind, payload, format) for _, kind, payload, format in stored] == [
                ("part.added", {"partIndex": 0}, 3),
                ("tool.started", {"toolCallId": "toolu_1", "name": "get_time"}, 2),
                ("tool.completed", {"toolCallId": "toolu_1", "name": "get_time"}, 2),
                (
                    ("usage.updated", {"total": usage["total"]}, 4)
                    if stored_format >= formats.USAGE_BY_REFERENCE
                    else ("usage.updated", usage, 2)
                ),
                ("part.added", {"partIndex": 2}, 3),
                ("run.completed", {"taskOutcome": "resolved", "warnings": ["max_steps_near"]}, 3),
            ]
        else:
            assert [(seq, kind, payload) for seq, kind, payload, _ in stored] == published
            assert {format for *_, format in stored} == {formats.CURRENT}
        # The log's rows (its run.queued is the run's row, its run.started its attempt's, 0048):
        # one of them all from format 6 on, under the last one's seq; one an event before.
        if stored_format >= formats.EVENTS_TOGETHER:
            assert rows["rows"] == [
                (published[-1][0], formats.TOGETHER_TYPE, formats.EVENTS_TOGETHER)
            ]
        else:
            assert rows["rows"] == [(seq, kind, format) for seq, kind, _, format in stored]
        # The answer: its part alone from format 5 on, else the run's column too.
        whole = ("It is noon.", formats.CURRENT)
        by_reference = (None, formats.ANSWER_BY_REFERENCE)
        assert (rows["run"]["result_text"], rows["run"]["format"]) == (
            by_reference if stored_format >= formats.ANSWER_BY_REFERENCE else whole
        )
        assert run.result_text == "It is noon."  # as the completion returned it
        async with engine.connect() as conn:
            assert (await runs_repo.get_run(conn, "t1", run.run_id)).result_text == "It is noon."
        read = await _read_back(engine, run.run_id)
        assert [(e.seq, e.type, dict(e.payload)) for e in read[2:]] == published
        # A webhook delivery carries each one whole too, read on its own.
        async with engine.connect() as conn:
            for seq, kind, payload in published:
                one = await webhook_dispatch.stored_event(conn, run.run_id, seq)
                assert one is not None and (one.type, dict(one.payload)) == (kind, payload)


async def test_a_checkpoints_events_are_one_row_read_from_any_seq_within_it(
    engine: AsyncEngine,
) -> None:
    """A checkpoint's events (format 6) are one row under the last one's seq, and a page of
    the events after a seq inside that row starts at the next one; pinned to 5, each event is a
    row of its own. Read back, they are what was published."""
    await _tenant(engine, "t1")
    for stored_format in (formats.NEWEST, formats.ANSWER_BY_REFERENCE):
        execution = _execution(engine, stored_format)
        admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
        event = chat(f"k{stored_format}", conversation=f"k{stored_format}")
        run_id = (await admitter.admit(event)).run.run_id
        await _claim(execution)
        published = _recording(execution)
        batch = _tool_turn_then_answer(await _priced(engine, run_id, TOOL_TURN)).in_flight
        assert batch is not None and len(batch.events) == 4
        await execution.attempts.checkpoint(run_id, 1, batch)
        seqs = [seq for seq, *_ in published]
        # Its run.queued is the run's row, its run.started its attempt's (0048).
        rows = (await _stored(engine, run_id))["rows"]
        if stored_format >= formats.EVENTS_TOGETHER:
            assert rows == [(seqs[-1], formats.TOGETHER_TYPE, formats.EVENTS_TOGETHER)]
        else:
            assert [seq for seq, *_ in rows] == seqs
        read = await _read_back(engine, run_id)
        assert [(e.seq, e.type, dict(e.payload)) for e in read[2:]] == published
        async with engine.connect() as conn:
            after_second = await runs_repo.read_events(conn, run_id, seqs[1], 100)
        assert [e.seq for e in after_second] == seqs[2:]


async def test_an_answer_its_parts_do_not_hold_by_the_one_rule_is_stored_whole(
    engine: AsyncEngine,
) -> None:
    """A run a limit stopped answers with the text of every turn (`final_text(0)`), which its
    last turn's parts alone do not hold: the answer is stored whole, the row's format unchanged,
    and shown as the worker gave it."""
    await _tenant(engine, "t1")
    execution = _execution(engine)
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    run_id = (await admitter.admit(chat("e1", conversation="c1"))).run.run_id
    await _claim(execution)
    done = _tool_turn_then_answer()
    assert done.in_flight is not None
    said = Part(0, Role.ASSISTANT, Text("Let me look. "), final=True)
    call = replace(done.in_flight.parts[0], index=1)
    result = replace(done.in_flight.parts[1], index=2)
    answer = replace(done.parts[0], index=3)
    flight = replace(done.in_flight, parts=[said, call, result], events=[])
    stopped = replace(
        done,
        ending=Completed("Let me look. It is noon.", "unresolved"),
        in_flight=flight,
        parts=[answer],
        events=[],
    )
    await execution.attempts.complete(run_id, 1, stopped)
    rows = await _stored(engine, run_id)
    assert (rows["run"]["result_text"], rows["run"]["format"]) == (
        "Let me look. It is noon.",
        formats.CURRENT,
    )
    async with engine.connect() as conn:
        shown = await runs_repo.get_run(conn, "t1", run_id)
    assert shown.result_text == "Let me look. It is noon."


def _ending_with(parts: list[Part], answer: str) -> Completion:
    return Completion(
        Completed(answer),
        parts=parts,
        turns=[ModelTurn(MODEL, 120, 30)],
        stages={"attempt_ms": 20.0},
        audit={"model": MODEL},
    )


async def test_each_run_shows_the_answer_its_own_parts_hold(engine: AsyncEngine) -> None:
    """Runs of every shape, completed side by side (so that a rule reading another run's parts
    would show): the answer is the assistant's text after the run's last part that is not the
    assistant's, stored by reference when the worker's answer is exactly that; a run with no
    answer stores none."""
    await _tenant(engine, "t1")
    execution = _execution(engine)
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())

    def call(index: int) -> Part:
        return Part(index, Role.ASSISTANT, ToolCall(f"toolu_{index}", "get_time", {}), final=True)

    def result(index: int) -> Part:
        return Part(index, Role.TOOL, ToolResult(f"toolu_{index - 1}", "noon"), final=True)

    def text(index: int, said: str) -> Part:
        return Part(index, Role.ASSISTANT, Text(said), final=True)

    shapes = {
        "one text": ([text(0, "a")], "a"),
        "tool, then two texts": ([call(0), result(1), text(2, "b1 "), text(3, "b2")], "b1 b2"),
        "text, tool, text": ([text(0, "x "), call(1), result(2), text(3, "y")], "y"),
        "no text": ([call(0), result(1)], ""),
    }
    ids = {}
    for i, (name, (parts, answer)) in enumerate(shapes.items()):
        ids[name] = (await admitter.admit(chat(f"s{i}", conversation=f"s{i}"))).run.run_id
        await _claim(execution)
        await execution.attempts.complete(ids[name], 1, _ending_with(parts, answer))
    for name, (_, answer) in shapes.items():
        stored = (await _stored(engine, ids[name]))["run"]
        async with engine.connect() as conn:
            shown = await runs_repo.get_run(conn, "t1", ids[name])
        assert (shown.result_text or "") == answer, name
        expected = (None, formats.ANSWER_BY_REFERENCE) if answer else (None, formats.CURRENT)
        assert (stored["result_text"], stored["format"]) == expected, name


async def test_a_batch_that_landed_already_is_not_written_again(engine: AsyncEngine) -> None:
    await _tenant(engine, "t1")
    execution = _execution(engine)
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    run_id = (await admitter.admit(chat("e1", conversation="c1"))).run.run_id
    await _claim(execution)
    done = _tool_turn_then_answer()
    assert done.in_flight is not None
    await execution.attempts.checkpoint(run_id, 1, done.in_flight)  # its answer was lost
    await execution.attempts.complete(run_id, 1, done)
    stored = await _stored(engine, run_id)
    assert [s for s, *_ in stored["events"]] == list(range(1, len(stored["events"]) + 1))
    assert [t for _, t, *_ in stored["events"]].count("tool.started") == 1
    assert len(stored["turns"]) == 2 and len(stored["parts"]) == 3


async def test_a_cancel_accepted_first_ends_the_run_cancelled(engine: AsyncEngine) -> None:
    await _tenant(engine, "t1")
    execution = _execution(engine)
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    run_id = (await admitter.admit(chat("e1", conversation="c1"))).run.run_id
    await _claim(execution)
    async with engine.begin() as conn:
        assert await runs_repo.flag_cancel(conn, run_id) is not None
    row = await execution.attempts.complete(run_id, 1, _answer())
    assert row.status == "cancelled" and row.result_text is None
    stored = await _stored(engine, run_id)
    assert [t for _, t, *_ in stored["events"]][-1] == "run.cancelled"
    assert [p[3] for p in stored["parts"]] == [{"text": "the answer"}], "its parts were kept"
    assert [a[1] for a in stored["attempts"]] == ["cancelled"]


async def test_a_stale_lease_writes_nothing(engine: AsyncEngine) -> None:
    await _tenant(engine, "t1")
    execution = _execution(engine)
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    run_id = (await admitter.admit(chat("e1", conversation="c1"))).run.run_id
    await _claim(execution)
    before = await _stored(engine, run_id)
    with pytest.raises(StaleLease):
        await execution.attempts.complete(run_id, 2, _tool_turn_then_answer())
    assert await _stored(engine, run_id) == before
