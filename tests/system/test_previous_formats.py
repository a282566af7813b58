"""A rolling deploy runs two releases side by side, so this release must read what the release
before it stored: parts, events and pending interactions in format 1, kept as fixtures that
release (71abcdb) wrote on its own stack through its own CLI (`fixtures/format1_71abcdb.json`).
Runs it left parked resume here and finish; a payload in a format newer than this release's is
refused with a clear error, never read with a field dropped. And the other way: a run completed
here stores its answer once (format 3, run.completed by reference; format 5, the answer as its
parts alone) and each model turn's usage once (format 4, usage.updated without its turn), and
streams and reads whole, the events its completion appends in one row (format 6); while the
release before this one still runs, the orchestrator pinned to its format (5) stores nothing it
cannot read, nor pinned to the ones before that's (4, 3)."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from google.protobuf import json_format
from sqlalchemy import insert, select, update

from tests.system.execution_support import ExecStack, exec_stack, wait_for_status
from tether import apikeys, formats
from tether.client import TetherClient
from tether.db import schema
from tether.db.engine import create_engine
from tether.v1 import gateway_pb2, interactions_pb2

# The release before runs as processes beside this one, a process per role (make slow).
pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.slow]

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "format1_71abcdb.json").read_text())
# Parents before children (foreign keys).
TABLES = [
    "tenants",
    "sessions",
    "messages",
    "runs",
    "event_claims",
    "run_parts",
    "run_events",
    "interactions",
    "attempts",
    "usage_turns",
]
RUNS = {run["conversation_id"]: run for run in FIXTURE["runs"]}


def _value(value: Any) -> Any:
    """A dumped column value as the database takes it."""
    if isinstance(value, dict) and len(value) == 1:
        (tag, inner), *_ = value.items()
        if tag == "$json":
            return inner
        if tag == "$time":
            return datetime.fromisoformat(inner)
        if tag == "$bytes":
            return base64.b64decode(inner)
    return value


def _still_open(row: dict[str, Any]) -> dict[str, Any]:
    """A pending interaction with as long left to live as when it was captured: its expiry is a
    time of day, and the sweep would close it as expired by the time the suite runs."""
    if row["status"] != "pending" or row["expires_at"] is None:
        return row
    lifetime = row["expires_at"] - row["created_at"]
    return {**row, "expires_at": datetime.now(UTC) + lifetime}


async def load_fixture(db_url: str) -> str:
    """Store the previous release's rows as it left them (every `format` column takes its
    default, 1, as rows a release that knows no formats writes do); a key for its tenant and
    principal."""
    engine = create_engine(db_url, pool_size=1)
    try:
        async with engine.begin() as conn:
            for name in TABLES:
                table = schema.metadata.tables[name]
                rows = [
                    {
                        k: _value(v)
                        for k, v in row.items()
                        if not (name == "usage_turns" and k == "id")
                    }
                    for row in FIXTURE[name]
                ]
                if name == "interactions":
                    rows = [_still_open(row) for row in rows]
                await conn.execute(insert(table), rows)
            scopes = [*apikeys.CLIENT_SCOPES, "approvals:decide"]
            key, _ = await apikeys.create_key(conn, "dev", "dev", scopes)
    finally:
        await engine.dispose()
    return key


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[ExecStack, TetherClient]]:
    run_dir = Path(tmp_path_factory.mktemp("previous-formats"))
    async with exec_stack(pg_server_url, template_db, redis_url, run_dir, workers=1) as running:
        key = await load_fixture(running.db_url)
        # No retries: a refusal must be seen as it is answered.
        async with TetherClient(running.addr("gateway"), key, retry_for_s=0) as client:
            yield running, client


def stored_parts(run_id: str) -> list[dict[str, Any]]:
    rows = [p for p in FIXTURE["run_parts"] if p["run_id"] == run_id]
    return [{"index": p["part_index"], p["kind"]: _value(p["payload"])} for p in rows]


def read_parts(response: gateway_pb2.GetRunResponse) -> list[dict[str, Any]]:
    out = []
    for part in response.parts:
        kind = str(part.WhichOneof("kind"))
        out.append({"index": part.index, kind: json_format.MessageToDict(getattr(part, kind))})
    return out


async def test_every_part_the_previous_release_stored_reads_back_whole(
    stack: tuple[ExecStack, TetherClient],
) -> None:
    _, client = stack
    assert len(RUNS) == 7
    for run in RUNS.values():
        response = await client.get_run(run["run_id"])
        assert response.run.status != 0 and response.run.last_seq == run["last_seq"]
        assert read_parts(response) == stored_parts(run["run_id"]), run["conversation_id"]


async def test_every_event_the_previous_release_stored_streams_whole(
    stack: tuple[ExecStack, TetherClient],
) -> None:
    _, client = stack
    for run in RUNS.values():
        stored = [e for e in FIXTURE["run_events"] if e["run_id"] == run["run_id"]]
        streamed: list[Any] = []
        watch = client.watch(run["run_id"], give_up_after_s=10)
        async for item in watch:
            events = item.batch.events if item.HasField("batch") else [item.event]
            streamed += [e for e in events if item.WhichOneof("item") != "snapshot" and e.seq]
            if streamed and streamed[-1].seq == run["last_seq"]:
                break
        assert [(e.seq, e.type) for e in streamed] == [(e["seq"], e["type"]) for e in stored]
        for event, row in zip(streamed, stored, strict=True):
            member = getattr(event, str(event.WhichOneof("payload")))
            as_stored = json_format.ParseDict(_value(row["payload"]), type(member)())
            assert member == as_stored, row["type"]


async def test_the_pending_interactions_it_stored_read_back(
    stack: tuple[ExecStack, TetherClient],
) -> None:
    _, client = stack
    question = (await client.pending_question(RUNS["question"]["run_id"])).question
    stored = next(i for i in FIXTURE["interactions"] if i["run_id"] == RUNS["question"]["run_id"])
    assert question.interaction_id == stored["interaction_id"]
    specs = [
        json_format.ParseDict(q, interactions_pb2.QuestionSpec())
        for q in _value(stored["questions"])
    ]
    assert list(question.questions) == specs
    approval = (await client.pending_approval(RUNS["pending-approval"]["run_id"])).approval
    assert approval.tool_name == "publish_post"
    assert json_format.MessageToDict(approval.input) == {"text": "still pending"}
    connection = (await client.pending_connection(RUNS["connection"]["run_id"])).connection
    assert connection.provider == "democal" and connection.login_url


async def test_runs_it_left_parked_resume_and_finish_here(
    stack: tuple[ExecStack, TetherClient],
) -> None:
    running, client = stack
    approval_run = RUNS["pending-approval"]["run_id"]
    await client.decide(approval_run, "allow-once")
    question_run = RUNS["question"]["run_id"]
    await client.answer(question_run, {"choice": ["Option A"]})
    for run_id in (approval_run, question_run):
        await wait_for_status(running.db_url, run_id, "completed")
    # What runs is what the previous release showed: its stored input, once.
    posted = [r for r in running.ledger.records if r.body.get("text") == "still pending"]
    assert len(posted) == 1
    answered = (await client.get_run(question_run)).run.result_text
    assert "Option A" in answered


async def test_a_part_in_a_newer_format_is_refused_not_read_with_a_field_dropped(
    stack: tuple[ExecStack, TetherClient],
) -> None:
    running, client = stack
    run_id = RUNS["text"]["run_id"]
    engine = create_engine(running.db_url, pool_size=1)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                update(schema.run_parts)
                .where(schema.run_parts.c.run_id == run_id)
                .values(format=formats.NEWEST + 1)
            )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.get_run(run_id)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"stored in format {formats.NEWEST + 1}, newer than this release reads" in str(
            refused.value.details()
        )
    finally:
        async with engine.begin() as conn:
            await conn.execute(
                update(schema.run_parts).where(schema.run_parts.c.run_id == run_id).values(format=1)
            )
        await engine.dispose()


async def _stored(db_url: str, run_id: str) -> tuple[Any, list[Any], list[Any]]:
    """The run's row, its stored events in order (as the log's readers take them), and the
    log's own rows (one an event, or one of the events a write appended together)."""
    engine = create_engine(db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            runs, events, rows = schema.runs, schema.run_event_log, schema.run_events
            run = (await conn.execute(select(runs).where(runs.c.run_id == run_id))).one()
            stored = (
                await conn.execute(
                    select(events).where(events.c.run_id == run_id).order_by(events.c.seq)
                )
            ).all()
            logged = (
                await conn.execute(select(rows).where(rows.c.run_id == run_id).order_by(rows.c.seq))
            ).all()
    finally:
        await engine.dispose()
    return run, list(stored), list(logged)


async def _streamed(client: TetherClient, run_id: str) -> dict[str, Any]:
    """What a client replaying the finished run gets: each event's payload by type (the last
    of each)."""
    seen: dict[str, Any] = {}
    async for item in client.watch(run_id, give_up_after_s=10):
        events = item.batch.events if item.HasField("batch") else [item.event]
        for event in events:
            kind = event.WhichOneof("payload")
            if item.WhichOneof("item") == "snapshot" or kind is None:
                continue
            seen[event.type] = getattr(event, kind)
            if event.type == "run.completed":
                return seen
    raise AssertionError(f"no run.completed streamed for {run_id}")


async def test_a_run_this_release_completes_stores_each_record_once_and_streams_whole(
    stack: tuple[ExecStack, TetherClient],
) -> None:
    running, client = stack
    sent = await client.send("hello", conversation_id="stored-once", event_id="stored-once")
    run_id = sent.run.run_id
    await wait_for_status(running.db_url, run_id, "completed")
    run, stored, logged = await _stored(running.db_url, run_id)
    # The answer is its part alone (format 5): the row keeps no copy.
    assert (run.result_text, run.format) == (None, formats.ANSWER_BY_REFERENCE)
    # The events one write appended are one row (format 6: the completion's, and a checkpoint's
    # that landed before it), under the last one's seq; read, they are every seq in turn.
    # Its run.queued is read from the run's row, its run.started from its attempt's (0048): no
    # row of the log holds either.
    assert [(e.seq, e.type) for e in stored[:2]] == [(1, "run.queued"), (2, "run.started")]
    assert not {r.type for r in logged} & {"run.queued", "run.started"}
    together = [r for r in logged if r.format == formats.EVENTS_TOGETHER]
    assert together and {r.type for r in together} == {formats.TOGETHER_TYPE}
    assert logged[-1].seq == run.last_seq and len(logged) < len(stored)
    assert [e.seq for e in stored] == list(range(1, run.last_seq + 1))
    by_type = {e.type: e for e in stored}
    terminal, added = by_type["run.completed"], by_type["part.added"]
    assert (terminal.format, added.format) == (formats.BY_REFERENCE, formats.BY_REFERENCE)
    assert "resultText" not in terminal.payload and "usage" not in terminal.payload
    assert set(added.payload) == {"partIndex"}
    # The turn the worker priced is the row the orchestrator priced: its event names it.
    usage = by_type["usage.updated"]
    assert (usage.format, set(usage.payload)) == (formats.USAGE_BY_REFERENCE, {"total"})
    [turn] = await _turns(running.db_url, run_id)
    assert turn.event_seq == usage.seq
    streamed = await _streamed(client, run_id)
    completed, part = streamed["run.completed"], streamed["part.added"].part
    assert completed.result_text == part.text.text and part.text.text and part.final
    shown = (await client.get_run(run_id)).run
    assert shown.result_text == part.text.text
    listed = [r for r in (await client.list_runs()).runs if r.run_id == run_id]
    assert [r.result_text for r in listed] == [part.text.text]
    assert completed.usage.output_tokens == run.usage["output_tokens"] > 0
    streamed_turn = streamed["usage.updated"].turn
    assert (streamed_turn.model, streamed_turn.output_tokens, streamed_turn.cost_micros) == (
        turn.model,
        turn.output_tokens,
        turn.cost_micros,
    )
    assert streamed_turn.output_tokens > 0 and streamed_turn.cost_micros > 0


async def _turns(db_url: str, run_id: str) -> list[Any]:
    engine = create_engine(db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            turns = schema.usage_turns
            return list(
                (
                    await conn.execute(
                        select(turns).where(turns.c.run_id == run_id).order_by(turns.c.id)
                    )
                ).all()
            )
    finally:
        await engine.dispose()


@pytest.mark.parametrize(
    "pin", [formats.ANSWER_BY_REFERENCE, formats.USAGE_BY_REFERENCE, formats.BY_REFERENCE]
)
async def test_while_a_release_before_runs_a_completion_is_stored_as_it_reads_it(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: Any, pin: int
) -> None:
    """During a rolling deploy from the release before (TETHER_ORCHESTRATOR_STORED_FORMAT=5),
    each event is a row of its own (a row of several, format 6, that release refuses, is not
    written); from the one before that (4), a run's answer is stored whole too
    (`runs.result_text`; the row's format, 5, is not written); from the one before that (3),
    usage.updated is whole too, with its turn (format 4). A deploy from the release before those
    pins 2, and every event is whole (test_completion_statement covers each pin)."""
    run_dir = Path(tmp_path_factory.mktemp("pinned-format"))
    pinned = {"TETHER_ORCHESTRATOR_STORED_FORMAT": str(pin)}
    async with exec_stack(
        pg_server_url, template_db, redis_url, run_dir, workers=1, extra_env=pinned
    ) as running:
        key = await load_fixture(running.db_url)
        async with TetherClient(running.addr("gateway"), key, retry_for_s=0) as client:
            sent = await client.send("hello", conversation_id="pinned", event_id="pinned")
            run_id = sent.run.run_id
            await wait_for_status(running.db_url, run_id, "completed")
            run, stored, logged = await _stored(running.db_url, run_id)
            # After the two read from the run's and its attempt's rows (0048).
            assert [(r.seq, r.type, r.format) for r in logged] == [
                (e.seq, e.type, e.format) for e in stored[2:]
            ], "one row an event"
            if pin == formats.ANSWER_BY_REFERENCE:
                assert (run.result_text, run.format) == (None, formats.ANSWER_BY_REFERENCE)
            else:
                assert run.result_text and run.format == formats.CURRENT
            by_type = {e.type: e for e in stored}
            usage = by_type["usage.updated"]
            if pin == formats.BY_REFERENCE:
                assert {e.format for e in stored} == {formats.CURRENT, formats.BY_REFERENCE}
                assert usage.format == formats.CURRENT
                assert int(usage.payload["turn"]["outputTokens"]) == run.usage["output_tokens"]
            else:
                assert usage.format == formats.USAGE_BY_REFERENCE
            streamed = await _streamed(client, run_id)
            answer = streamed["run.completed"].result_text
            assert answer and answer == (run.result_text or streamed["part.added"].part.text.text)
            assert streamed["usage.updated"].turn.output_tokens == run.usage["output_tokens"]
