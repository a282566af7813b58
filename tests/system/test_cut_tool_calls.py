"""A tool_use block cut mid-stream is not a call: it never runs and is never sent back to the
model; it is kept for audit, superseded (like every part a cut-off attempt leaves, see
test_superseded_parts), and the retry regenerates the turn. Services run as
real processes; the local model server breaks the stream inside the call's input_json deltas,
or the worker is SIGKILLed while the call streams."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.system.execution_support import (
    ExecStack,
    events_of,
    exec_stack,
    parts_of,
    run_row,
    wait_for_status,
)
from tether.testing.eventually import eventually
from tether.testing.model_server import MidStreamError, TextTurn, ToolUseTurn

# Slow: a worker SIGKILLed while a call streams, attempts retried (make slow).
pytestmark = pytest.mark.slow

CHUNKS = ['{"te', 'xt": "We la', "unch to", 'day"}']


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def drill(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ExecStack]:
    """One stack with two workers: when one is killed, the other takes the run over."""
    run_dir = Path(tmp_path_factory.mktemp("cut-calls"))
    async with exec_stack(pg_server_url, template_db, redis_url, run_dir, workers=2) as stack:
        yield stack


def prompt(label: str) -> str:
    return f"{label} {uuid.uuid4().hex}"


async def assert_cut_and_never_run(drill: ExecStack, key: str, run_id: str, call_id: str) -> None:
    """The cut call is stored superseded, never ran, and the next model request left it out."""
    assert drill.ledger.records == [], "the cut call never ran"
    parts = await parts_of(drill.db_url, run_id)
    results = [p.payload for p in parts if p.kind == "tool_result"]
    assert results == [], "a cut call gets no tool_result"
    events = await events_of(drill.db_url, run_id)
    started = [p for _, t, p in events if t in ("tool.started", "tool.completed", "tool.failed")]
    assert started == [], "nothing about it ran"
    calls = [p for p in parts if p.kind == "tool_call"]
    assert [(c.payload["toolCallId"], c.superseded_at is not None) for c in calls] == [
        (call_id, True)
    ], "kept, superseded, for audit"
    retried = [r for r in drill.model.requests if r.script_key == key][-1]
    sent = [b for m in retried.body["messages"] for b in m["content"] if isinstance(b, dict)]
    assert [b for b in sent if b.get("type") in ("tool_use", "tool_result")] == []
    assert parts[-1].payload["text"] == "Regenerated.", "the retry regenerated the turn"


async def test_a_tool_call_cut_by_a_mid_stream_error_never_runs(drill: ExecStack) -> None:
    tenant = await drill.tenant(grant=["publish_post"])
    key = prompt("cut by the provider")
    call_id = f"toolu_{uuid.uuid4().hex[:20]}"
    drill.model.script(
        key,
        [
            # message_start, content_block_start, two of the input's four deltas, then error.
            ToolUseTurn(
                "publish_post",
                {"text": "We launch today"},
                tool_id=call_id,
                json_chunks=CHUNKS,
                fault=MidStreamError(after_events=4),
            ),
            TextTurn("Regenerated."),
        ],
    )
    run_id = await tenant.send(key)
    run = await wait_for_status(drill.db_url, run_id, "completed", "failed", timeout=30)
    assert (run.status, run.attempt) == ("completed", 2)
    await assert_cut_and_never_run(drill, key, run_id, call_id)


async def test_a_tool_call_cut_by_a_killed_worker_never_runs(drill: ExecStack) -> None:
    tenant = await drill.tenant(grant=["publish_post"])
    key = prompt("cut by a kill")
    call_id = f"toolu_{uuid.uuid4().hex[:20]}"
    chunks = [*CHUNKS[:3], *[" " for _ in range(200)], CHUNKS[3]]
    drill.model.script(
        key,
        [
            ToolUseTurn(
                "publish_post",
                {"text": "We launch today"},
                tool_id=call_id,
                json_chunks=chunks,
                delay_ms=30,
            ),
            TextTurn("Regenerated."),
        ],
    )
    run_id = await tenant.send(key)

    async def call_checkpointed() -> Any:
        calls = [p for p in await parts_of(drill.db_url, run_id) if p.kind == "tool_call"]
        return calls or None

    (streaming,) = await eventually(call_checkpointed, what="the streaming call checkpointed")
    assert not streaming.final
    drill.services.kill(await lease_holder(drill, run_id))
    run = await wait_for_status(drill.db_url, run_id, "completed", "failed", timeout=30)
    assert (run.status, run.attempt) == ("completed", 2)
    await assert_cut_and_never_run(drill, key, run_id, call_id)


async def lease_holder(drill: ExecStack, run_id: str) -> str:
    """The worker instance holding the run's lease (its worker id ends with its pid)."""
    owner = (await run_row(drill.db_url, run_id)).lease_owner
    (name,) = [
        name
        for name, proc in drill.services.procs.items()
        if name.startswith("worker") and owner.endswith(f"-{proc.process.pid}")
    ]
    return name
