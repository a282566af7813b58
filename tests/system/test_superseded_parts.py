"""A retried or recovered attempt's cut-off output is superseded: kept in the database, flagged
and tied to the attempt that wrote it, but left out of every read of the run's transcript and
of the history sent to the model, so each answer shows once. Live subscribers that rendered the
cut parts get `part.superseded`. Services run as real processes; the local model server breaks
the stream mid-answer, or the worker streaming the answer is SIGKILLed."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx2
import pytest
import pytest_asyncio
from google.protobuf import json_format
from sqlalchemy import select

from tests.system.execution_support import (
    ExecStack,
    Tenant,
    exec_stack,
    parts_of,
    run_row,
    wait_for_status,
)
from tests.system.streaming_support import Stream, get_run, metadata, prompt, read_run
from tether.db.engine import create_engine
from tether.db.schema import attempts
from tether.testing.eventually import eventually
from tether.testing.model_server import (
    BlocksTurn,
    MidStreamError,
    TextBlock,
    ThinkingBlock,
)
from tether.transport import apply_part_event
from tether.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

# Slow: a worker SIGKILLed mid-stream, attempts retried and recovered (make slow).
pytestmark = pytest.mark.slow


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ExecStack]:
    """No worker at first: each test subscribes to its run before a worker may claim it."""
    run_dir = Path(tmp_path_factory.mktemp("superseded"))
    async with exec_stack(pg_server_url, template_db, redis_url, run_dir, workers=0) as running:
        yield running


Said = list[tuple[str, str]]


def said(parts: Sequence[dict[str, Any]]) -> Said:
    """What a transcript shows, part by part: (kind, its words), from parts' protobuf JSON."""
    out: Said = []
    for part in parts:
        if "text" in part:
            out.append(("text", part["text"].get("text", "")))
        elif "thinking" in part:
            out.append(("thinking", part["thinking"].get("thinking", "")))
        elif "toolCall" in part:
            out.append(("tool_call", part["toolCall"].get("name", "")))
        elif "toolResult" in part:
            out.append(("tool_result", part["toolResult"].get("content", "")))
    return out


def said_by(parts: Sequence[common_pb2.Part]) -> Said:
    return said([json_format.MessageToDict(p) for p in parts])


@dataclass
class LiveWatch:
    """A StreamRun with deltas, connected before the run's first attempt starts."""

    stream: Stream
    task: asyncio.Task[None]


async def watch_live(tenant: Tenant, run_id: str) -> LiveWatch:
    """Subscribe to the run and return once the subscription is live (its snapshot arrived:
    the gateway follows the run's channel before it reads the snapshot)."""
    stream = Stream()
    connected = asyncio.Event()

    async def read() -> None:
        async with grpc.aio.insecure_channel(tenant.stack.addr("gateway")) as channel:
            call = gateway_pb2_grpc.GatewayServiceStub(channel).StreamRun(
                gateway_pb2.StreamRunRequest(run_id=run_id, include_deltas=True),
                metadata=tenant.metadata,
            )
            async for response in call:
                stream.take(response)
                connected.set()

    task = asyncio.create_task(read(), name=f"watch-{run_id}")
    await asyncio.wait_for(connected.wait(), 20)
    return LiveWatch(stream, task)


def replay(snapshot: Sequence[common_pb2.Part], stream: Stream) -> list[common_pb2.Part]:
    """The transcript a live client holds: its snapshot, then every part event applied."""
    parts = {p.index: p for p in snapshot}
    for event in stream.durable:
        apply_part_event(parts, event)
    return [parts[i] for i in sorted(parts)]


def replay_json(lines: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same for `tether watch --json` output, as a script reading it would do."""
    parts = {p.get("index", 0): p for p in lines[0]["parts"]}
    for line in lines[1:]:
        if line["type"] in ("part.added", "part.updated"):
            part = line["payload"]["part"]
            parts[part.get("index", 0)] = part
        elif line["type"] == "part.superseded":
            parts.pop(line["payload"].get("partIndex", 0), None)
    return [parts[i] for i in sorted(parts)]


async def tether_watch_json(
    stack: ExecStack, tenant: Tenant, run_id: str, directory: Path
) -> list[dict[str, Any]]:
    """`tether watch RUN --json`, run as a user would, one object per line."""
    config = directory / f"stack-{uuid.uuid4().hex[:8]}.json"
    config.write_text(json.dumps({"gateway": stack.addr("gateway"), "api_key": tenant.api_key}))
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tether.cli",
        "watch",
        run_id,
        "--json",
        "--stack",
        str(config),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, out.decode() + err.decode()
    return [json.loads(line) for line in out.decode().splitlines()]


async def http_reads(stack: ExecStack, tenant: Tenant, run_id: str) -> tuple[Said, Said, list[int]]:
    """The transcript from the HTTP bridge: GET /v1/runs/{id}, and the SSE stream's snapshot;
    and the parts GET /v1/runs/{id}?superseded=1 flags."""
    base = f"http://{stack.services.http_addresses()['gateway']}"
    headers = {"Authorization": f"Bearer {tenant.api_key}"}
    async with httpx2.AsyncClient(timeout=30) as http:
        run = (await http.get(f"{base}/v1/runs/{run_id}", headers=headers)).json()
        url = f"{base}/v1/runs/{run_id}?superseded=1"
        audit = (await http.get(url, headers=headers)).json()
        async with http.stream(
            "GET", f"{base}/v1/runs/{run_id}/events?deltas=0", headers=headers
        ) as response:
            async for frame in httpx2.EventSource(response):
                assert frame.event == "snapshot", frame
                snapshot = frame.json()
                break
    flagged = [p.get("index", 0) for p in audit["parts"] if p.get("superseded")]
    return said(run["parts"]), said(snapshot["parts"]), flagged


async def get_run_audit(tenant: Tenant, run_id: str) -> gateway_pb2.GetRunResponse:
    """GetRun with the superseded parts too, flagged."""
    async with grpc.aio.insecure_channel(tenant.stack.addr("gateway")) as channel:
        response: gateway_pb2.GetRunResponse = await gateway_pb2_grpc.GatewayServiceStub(
            channel
        ).GetRun(
            gateway_pb2.GetRunRequest(run_id=run_id, include_superseded=True),
            metadata=metadata(tenant.api_key),
        )
    return response


async def attempt_epochs(stack: ExecStack, run_id: str) -> dict[int, int]:
    """Attempt number -> lease epoch, from the attempts table."""
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(attempts.c.attempt, attempts.c.lease_epoch).where(
                        attempts.c.run_id == run_id
                    )
                )
            ).all()
    finally:
        await engine.dispose()
    return {r.attempt: r.lease_epoch for r in rows}


async def assert_each_answer_once(
    stack: ExecStack,
    tenant: Tenant,
    run_id: str,
    key: str,
    live: LiveWatch,
    directory: Path,
    *,
    answer: Said,
    cut: Said,
) -> None:
    """Every read of the transcript shows `answer` (the last attempt's parts) once; the first
    attempt's `cut` parts stay in the database, superseded, tied to that attempt; live clients
    were told to drop them; the retried model call never saw them."""
    await asyncio.wait_for(live.task, 30)
    found = await get_run(tenant, run_id)
    assert said_by(found.parts) == answer, "GetRun"
    later = await read_run(tenant, run_id)
    assert said_by(later.snapshots[0].parts) == answer, "StreamRun snapshot"
    via_http, via_sse, flagged_over_http = await http_reads(stack, tenant, run_id)
    assert via_http == answer, "GET /v1/runs/{id}"
    assert via_sse == answer, "SSE snapshot"
    lines = await tether_watch_json(stack, tenant, run_id, directory)
    assert said(lines[0]["parts"]) == answer, "tether watch --json snapshot"
    assert said(replay_json(lines)) == answer, "tether watch --json, events applied"
    assert said_by(replay(live.stream.snapshots[0].parts, live.stream)) == answer, "live client"

    rows = await parts_of(stack.db_url, run_id)
    superseded = [r for r in rows if r.superseded_at is not None]
    epochs = await attempt_epochs(stack, run_id)
    assert said([{r.kind.replace("tool_call", "toolCall"): r.payload} for r in superseded]) == cut
    assert {r.lease_epoch for r in superseded} == {epochs[1]}, "tied to the attempt cut off"
    kept = [r for r in rows if r.superseded_at is None]
    assert {r.lease_epoch for r in kept} == {epochs[2]}
    audit = await get_run_audit(tenant, run_id)
    flagged = [p.index for p in audit.parts if p.superseded]
    assert flagged == [r.part_index for r in superseded], "visible with the flag when asked"
    assert flagged_over_http == flagged, "GET /v1/runs/{id}?superseded=1"

    notices = [e.part_superseded for e in live.stream.durable if e.type == "part.superseded"]
    dropped = [n.part_index for n in notices]
    assert dropped == [r.part_index for r in superseded], "live clients told to drop each one"
    assert {n.attempt for n in notices} == {1}
    rendered = {e.text_delta.part_index for e in live.stream.events if e.type == "text.delta"}
    assert rendered & set(dropped), "the live client had rendered deltas of a cut part"

    first, retried = [r for r in stack.model.requests if r.script_key == key]
    assert without_facts(retried.body) == without_facts(first.body), "the retry saw nothing cut"


def without_facts(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's messages without its live facts block, which each attempt builds afresh:
    its time is to the minute, so a retry that crosses a minute says another time."""
    first, *rest = body["messages"]
    facts, *content = first["content"]
    assert facts["text"].startswith("<live_facts>"), "each attempt is sent its live facts"
    return [{**first, "content": content}, *rest]


THINKING = ThinkingBlock("Weighing it up.", chunks=["Weighing ", "it up."])
LEAD = TextBlock("The short answer: ", chunks=["The short ", "answer: "])
REST = "yes, because the cache is warm."


async def test_a_mid_stream_provider_error_leaves_each_word_once(
    stack: ExecStack, tmp_path: Path
) -> None:
    tenant = await stack.tenant()
    key = prompt("cut by the provider")
    rest = TextBlock(REST, chunks=["yes, ", "because ", "the cache ", "is warm."])
    stack.model.script(
        key,
        [
            # message_start, the thinking and the lead whole (14 events), then two deltas of
            # the last block: "yes, because " and the provider's overloaded error.
            BlocksTurn(blocks=[THINKING, LEAD, rest], fault=MidStreamError(after_events=14)),
            BlocksTurn(blocks=[THINKING, LEAD, rest]),
        ],
    )
    conversation = f"c-{uuid.uuid4().hex[:8]}"
    run_id = await tenant.send(key, conversation)
    live = await watch_live(tenant, run_id)
    worker = await stack.start_worker()
    try:
        run = await wait_for_status(stack.db_url, run_id, "completed", "failed", timeout=30)
        assert (run.status, run.attempt, run.result_text) == ("completed", 2, LEAD.text + REST)
        await assert_each_answer_once(
            stack,
            tenant,
            run_id,
            key,
            live,
            tmp_path,
            answer=[("thinking", THINKING.thinking), ("text", LEAD.text), ("text", REST)],
            cut=[("thinking", THINKING.thinking), ("text", LEAD.text), ("text", "yes, because ")],
        )
        # The conversation's next message sees the answer once, too (its requests still carry
        # the conversation's first message, the script key).
        stack.model.script(key, [BlocksTurn(blocks=[TextBlock("Then nothing.")])])
        follow_up = await tenant.send(prompt("and then?"), conversation)
        await wait_for_status(stack.db_url, follow_up, "completed", timeout=30)
        history = [r for r in stack.model.requests if r.script_key == key][-1].body["messages"]
        assert [m["role"] for m in history] == ["user", "assistant", "user"]
        assert [b.get("text") or b.get("thinking") for b in history[1]["content"]] == [
            THINKING.thinking,
            LEAD.text,
            REST,
        ]
    finally:
        await stack.services.stop(worker, grace=5)


async def test_a_worker_killed_mid_stream_leaves_each_word_once(
    stack: ExecStack, tmp_path: Path
) -> None:
    tenant = await stack.tenant()
    key = prompt("cut by a kill")
    words = [f"k{i} " for i in range(300)]
    stack.model.script(
        key,
        [
            # A whole lead, then a long text the kill cuts.
            BlocksTurn(blocks=[LEAD, TextBlock("".join(words), chunks=words)], delay_ms=30),
            BlocksTurn(blocks=[LEAD, TextBlock(REST)]),
        ],
    )
    run_id = await tenant.send(key)
    live = await watch_live(tenant, run_id)
    first = await stack.start_worker()

    async def cut_text_checkpointed() -> str | None:
        parts = await parts_of(stack.db_url, run_id)
        streaming = parts[1].payload.get("text", "") if len(parts) > 1 else ""
        return streaming if len(streaming) > 20 else None

    persisted = await eventually(cut_text_checkpointed, what="the streaming text checkpointed")
    stack.services.kill(first)
    second = await stack.start_worker()
    try:
        run = await wait_for_status(stack.db_url, run_id, "completed", "failed", timeout=30)
        assert (run.status, run.attempt, run.result_text) == ("completed", 2, LEAD.text + REST)
        rows = await parts_of(stack.db_url, run_id)
        assert rows[1].payload["text"].startswith(persisted), "the persisted part survived"
        cut_text = rows[1].payload["text"]
        await assert_each_answer_once(
            stack,
            tenant,
            run_id,
            key,
            live,
            tmp_path,
            answer=[("text", LEAD.text), ("text", REST)],
            cut=[("text", LEAD.text), ("text", cut_text)],
        )
    finally:
        await stack.services.stop(second, grace=5)
    assert (await run_row(stack.db_url, run_id)).status == "completed"
