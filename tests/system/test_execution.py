"""Durable execution with the services as processes: retries, cancellation, limits, ordering.

One stack (one worker) serves the module; each test uses its own tenant (with its own agent
limits) and its own scripted conversation on the local model server.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path

import pytest
import pytest_asyncio
from sqlalchemy import select

from tests.system.execution_support import (
    ExecStack,
    events_of,
    exec_stack,
    parts_of,
    run_row,
    wait_for_status,
)
from tether.db.engine import create_engine
from tether.db.schema import attempts, tool_outputs
from tether.testing.eventually import eventually
from tether.testing.model_server import (
    ErrorTurn,
    MidStreamError,
    TextTurn,
    ToolUseTurn,
    Usage,
)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ExecStack]:
    async with exec_stack(
        pg_server_url, template_db, redis_url, Path(tmp_path_factory.mktemp("exec")), workers=1
    ) as running:
        yield running


def prompt(label: str) -> str:
    """A unique first message: the model server's script key."""
    return f"{label} {uuid.uuid4().hex}"


def types(events: list[tuple[int, str, dict[str, object]]]) -> list[str]:
    return [t for _, t, _ in events]


async def test_a_run_streams_text_calls_a_tool_and_completes(stack: ExecStack) -> None:
    tenant = await stack.tenant()
    text = prompt("time please")
    stack.model.script(
        text,
        [
            ToolUseTurn("get_time", {}, text="Checking."),
            TextTurn("It is now.", chunks=["It ", "is ", "now."]),
        ],
    )
    run_id = await tenant.send(text)
    run = await wait_for_status(stack.db_url, run_id, "completed")
    assert run.result_text == "It is now."
    assert run.task_outcome == "resolved"
    kinds = [(p.role, p.kind, p.final) for p in await parts_of(stack.db_url, run_id)]
    assert kinds == [
        ("assistant", "text", True),
        ("assistant", "tool_call", True),
        ("tool", "tool_result", True),
        ("assistant", "text", True),
    ]
    seen = types(await events_of(stack.db_url, run_id))
    assert seen[0] == "run.queued" and seen[-1] == "run.completed"
    for expected in ("run.started", "tool.started", "tool.completed", "usage.updated"):
        assert expected in seen
    seqs = [s for s, _, _ in await events_of(stack.db_url, run_id)]
    assert seqs == list(range(1, len(seqs) + 1)), "the log has no gap"
    assert run.usage["input_tokens"] > 0 and run.usage["cost_micros"] > 0
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            (attempt,) = (
                await conn.execute(select(attempts).where(attempts.c.run_id == run_id))
            ).all()
    finally:
        await engine.dispose()
    assert attempt.outcome == "completed"
    assert set(attempt.stages) == {
        "routing_ms",
        "context_ms",
        "attempt_ms",
        "finalisation_ms",
        "total_ms",
    }
    assert attempt.stages["total_ms"] >= attempt.stages["attempt_ms"] > 0


async def test_429_with_retry_after_ms_waits_at_least_that_long(stack: ExecStack) -> None:
    tenant = await stack.tenant()
    text = prompt("rate limited")
    stack.model.script(text, [ErrorTurn(429, retry_after_ms=700), TextTurn("ok now")])
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "completed")
    requests = [r for r in stack.model.requests if r.script_key == text]
    assert len(requests) == 2
    gap = requests[1].timestamp - requests[0].timestamp
    assert gap >= 0.7, f"retried after {gap:.3f}s, before retry-after-ms allowed"
    pending = [p for _, t, p in await events_of(stack.db_url, run_id) if t == "run.retry-pending"]
    assert len(pending) == 1
    assert pending[0]["attempt"] == 1 and pending[0]["maxAttempts"] == 3
    assert pending[0]["error"]["code"] == "provider_rate_limited"
    assert "nextAttemptAt" in pending[0]


async def test_400_fails_at_once_without_a_retry(stack: ExecStack) -> None:
    tenant = await stack.tenant()
    text = prompt("bad request")
    stack.model.script(text, [ErrorTurn(400, message="messages: bad shape")])
    run_id = await tenant.send(text)
    run = await wait_for_status(stack.db_url, run_id, "failed")
    assert run.error["code"] == "provider_bad_request"
    assert run.error["retryable"] is False
    assert len([r for r in stack.model.requests if r.script_key == text]) == 1
    assert "run.retry-pending" not in types(await events_of(stack.db_url, run_id))


async def test_529_and_a_mid_stream_overload_are_retried_with_attempt_numbers(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant()
    text = prompt("overloaded")
    stack.model.script(
        text,
        [
            ErrorTurn(529),
            TextTurn("partial words that will be cut", fault=MidStreamError(after_events=4)),
            TextTurn("finally"),
        ],
    )
    run_id = await tenant.send(text)
    run = await wait_for_status(stack.db_url, run_id, "completed")
    assert run.attempt == 3
    assert run.result_text == "finally"
    pending = [p for _, t, p in await events_of(stack.db_url, run_id) if t == "run.retry-pending"]
    assert [p["attempt"] for p in pending] == [1, 2]
    assert [p["error"]["code"] for p in pending] == ["provider_overloaded", "provider_overloaded"]
    queued = [p for _, t, p in await events_of(stack.db_url, run_id) if t == "run.queued"]
    assert [(p.get("attempt"), p.get("reason")) for p in queued] == [
        (1, "admitted"),
        (2, "retry"),
        (3, "retry"),
    ]


async def test_exhausted_retries_fail_with_the_last_error(stack: ExecStack) -> None:
    tenant = await stack.tenant(max_attempts=3)
    text = prompt("always overloaded")
    stack.model.script(
        text, [ErrorTurn(529), ErrorTurn(503), ErrorTurn(529, message="still overloaded")]
    )
    run_id = await tenant.send(text)
    run = await wait_for_status(stack.db_url, run_id, "failed")
    assert run.error["code"] == "provider_overloaded"
    assert "still overloaded" in run.error["message"]
    pending = [p for _, t, p in await events_of(stack.db_url, run_id) if t == "run.retry-pending"]
    assert [p["attempt"] for p in pending] == [1, 2]
    assert types(await events_of(stack.db_url, run_id))[-1] == "run.failed"


async def test_cancel_during_streaming_closes_the_provider_connection(stack: ExecStack) -> None:
    tenant = await stack.tenant()
    text = prompt("long answer")
    words = [f"word{i} " for i in range(200)]
    stack.model.script(text, [TextTurn("".join(words), chunks=words, delay_ms=50)])
    run_id = await tenant.send(text)

    async def streaming() -> bool:
        parts = await parts_of(stack.db_url, run_id)
        return bool(parts and parts[0].payload.get("text"))

    await eventually(streaming, what="streamed text to be checkpointed")
    cancelled = await tenant.cancel(run_id)
    assert cancelled.changed
    run = await wait_for_status(stack.db_url, run_id, "cancelled", timeout=5)
    assert run.error["code"] == "cancelled"
    await eventually(
        _async(
            lambda: any(
                r.script_key == text and r.outcome == "disconnected" for r in stack.model.requests
            )
        ),
        what="the provider connection to close",
    )
    parts = await parts_of(stack.db_url, run_id)
    assert parts and parts[0].payload["text"].startswith("word0 "), "persisted text kept"


async def test_cancel_during_a_tool_call_cancels_it_and_finalises_the_call(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant()
    text = prompt("slow tool")
    stack.model.script(text, [ToolUseTurn("slow_task", {"seconds": 60})])
    run_id = await tenant.send(text)

    async def tool_started() -> bool:
        return "tool.started" in types(await events_of(stack.db_url, run_id))

    await eventually(tool_started, what="the tool to start")
    await tenant.cancel(run_id)
    await wait_for_status(stack.db_url, run_id, "cancelled", timeout=5)
    parts = await parts_of(stack.db_url, run_id)
    result = [p for p in parts if p.kind == "tool_result"]
    assert len(result) == 1 and result[0].payload["isError"] is True
    assert result[0].payload["content"].startswith("interrupted")
    assert "tool.failed" in types(await events_of(stack.db_url, run_id))


async def test_cancelling_a_finished_run_reports_it_unchanged(stack: ExecStack) -> None:
    tenant = await stack.tenant()
    text = prompt("quick")
    stack.model.script(text, [TextTurn("done")])
    run_id = await tenant.send(text)
    before = await wait_for_status(stack.db_url, run_id, "completed")
    response = await tenant.cancel(run_id)
    assert not response.changed
    after = await run_row(stack.db_url, run_id)
    assert (after.status, after.updated_at) == ("completed", before.updated_at)


@pytest.mark.parametrize(
    ("limits", "turns", "warning"),
    [
        ({"max_steps": 2}, [ToolUseTurn("get_time")] * 3, "max_steps_exceeded"),
        ({"max_tool_calls": 1}, [ToolUseTurn("get_time")] * 3, "max_tool_calls_exceeded"),
        (
            {"max_output_tokens": 100},
            [TextTurn("long", usage=Usage(input_tokens=10, output_tokens=500))],
            "output_tokens_exceeded",
        ),
        (
            {"max_input_tokens": 100},
            [TextTurn("long", usage=Usage(input_tokens=5000, output_tokens=5))],
            "input_tokens_exceeded",
        ),
        (
            {"max_cost_micros": 1},
            [TextTurn("pricey", usage=Usage(input_tokens=1000, output_tokens=1000))],
            "cost_exceeded",
        ),
    ],
)
async def test_each_budget_limit_completes_the_run_with_its_reason(
    stack: ExecStack, limits: dict[str, int], turns: list[object], warning: str
) -> None:
    tenant = await stack.tenant(**limits)
    text = prompt(f"limit {warning}")
    stack.model.script(text, turns)  # type: ignore[arg-type]
    run_id = await tenant.send(text)
    run = await wait_for_status(stack.db_url, run_id, "completed")
    assert run.warnings == [warning, "budget_exhausted"]
    assert run.task_outcome == "unresolved", "runtime completed, the task did not"
    calls = [p for p in await parts_of(stack.db_url, run_id) if p.kind == "tool_call"]
    results = [p for p in await parts_of(stack.db_url, run_id) if p.kind == "tool_result"]
    assert len(calls) == len(results), "no tool call is left dangling"


async def test_wall_clock_limit_fails_the_run_with_its_reason(stack: ExecStack) -> None:
    tenant = await stack.tenant(wall_clock_seconds=1.0)
    text = prompt("too slow")
    stack.model.script(text, [ToolUseTurn("slow_task", {"seconds": 30})])
    run_id = await tenant.send(text)
    run = await wait_for_status(stack.db_url, run_id, "failed", timeout=10)
    assert run.error["code"] == "wall_clock_exceeded"


async def test_tool_output_above_the_inline_limit_is_stored_whole_and_truncated(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant(max_inline_tool_output_bytes=1000)
    text = prompt("big output")
    stack.model.script(text, [ToolUseTurn("big_output", {"bytes": 5000}), TextTurn("ok")])
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "completed")
    (result,) = [p for p in await parts_of(stack.db_url, run_id) if p.kind == "tool_result"]
    assert result.payload["truncated"] is True
    ref = result.payload["outputRef"]
    assert ref in result.payload["content"]
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            stored = (
                await conn.execute(select(tool_outputs).where(tool_outputs.c.output_ref == ref))
            ).one()
    finally:
        await engine.dispose()
    assert len(stored.content.encode()) == 5000
    model_saw = [r for r in stack.model.requests if r.script_key == text][1]
    sent = str(model_saw.body["messages"])
    assert ref in sent and len(sent) < 4000, "the model got the inline cut, not 5000 bytes"


async def test_a_follow_up_message_runs_after_the_active_run_in_order(stack: ExecStack) -> None:
    tenant = await stack.tenant()
    conversation = f"conv-{uuid.uuid4().hex[:8]}"
    first, second = prompt("first"), "second message"
    words = [f"w{i} " for i in range(20)]
    stack.model.script(first, [TextTurn("".join(words), chunks=words, delay_ms=40)])
    first_id = await tenant.send(first, conversation)
    await wait_for_status(stack.db_url, first_id, "running")
    second_id = await tenant.send(second, conversation)
    assert (await run_row(stack.db_url, second_id)).status == "queued"
    a = await wait_for_status(stack.db_url, first_id, "completed")
    b = await wait_for_status(stack.db_url, second_id, "completed")
    assert isinstance(a.finished_at, datetime) and b.started_at >= a.finished_at
    # The follow-up saw the first exchange as history.
    follow_up = [r for r in stack.model.requests if r.script_key == first][-1]
    assert len(follow_up.body["messages"]) == 3


def _async(check):  # type: ignore[no-untyped-def]
    async def probe() -> bool:
        return bool(check())

    return probe
