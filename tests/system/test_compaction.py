"""Compaction with the services as processes: a 300-turn conversation (the demo agent's short
turns, some with tool calls) is compacted as it grows, every request under the agent's budget,
with `context.compacted` events, tool calls always paired with their results; a worker SIGKILLed
during a compaction, or just after it, leaves one stored summary, not two."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from sqlalchemy import func, select, update

from services.worker.context.compaction import SUMMARY_INSTRUCTION
from tests.system.execution_support import (
    ExecStack,
    Tenant,
    exec_stack,
    run_row,
    wait_for_status,
)
from tether.db.engine import create_engine
from tether.db.schema import context_summaries, run_event_log, run_parts, runs, tenants
from tether.testing.eventually import eventually
from tether.testing.model_script import KEY_TEXT_LIMIT
from tether.testing.model_server import Stall, TextTurn
from tether.v1 import gateway_pb2

# Slow: a conversation grown turn by turn past two compactions, and workers SIGKILLed during and
# after a compaction (make slow).
pytestmark = pytest.mark.slow

TURNS = 300
BUDGET = 2_500
# The model server's script key of every summary request: its last block, the instruction.
SUMMARY_KEY = SUMMARY_INSTRUCTION[:KEY_TEXT_LIMIT]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def services(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ExecStack]:
    directory = Path(tmp_path_factory.mktemp("compaction"))
    async with exec_stack(pg_server_url, template_db, redis_url, directory, workers=0) as running:
        yield running


@pytest_asyncio.fixture(loop_scope="session")
async def stack(services: ExecStack) -> AsyncIterator[ExecStack]:
    """The module's services; each test starts its own workers, and they go with it."""
    yield services
    for name, proc in list(services.services.procs.items()):
        if name.startswith("worker") and proc.process.poll() is None:
            services.services.kill(name)


def agent(budget: int) -> dict[str, Any]:
    return {"tool_allowlist": ["get_time"], "context": {"budget_tokens": budget}}


async def send_all(
    stack: ExecStack, tenant: Tenant, texts: list[str], conversation: str
) -> list[str]:
    """Admit every message of the conversation (they run one at a time, in order)."""
    async with grpc.aio.insecure_channel(stack.addr("gateway")) as channel:
        stub = tenant.stub(channel)
        run_ids = []
        for text in texts:
            response = await stub.SendMessage(
                gateway_pb2.SendMessageRequest(
                    text=text, conversation_id=conversation, event_id=f"e-{uuid.uuid4().hex}"
                ),
                metadata=tenant.metadata,
            )
            run_ids.append(str(response.run.run_id))
    return run_ids


def input_total(usage: dict[str, int]) -> int:
    return (
        usage["input_tokens"]
        + usage["cache_creation_input_tokens"]
        + usage["cache_read_input_tokens"]
    )


def _instructs(body: dict[str, Any]) -> bool:
    last = body["messages"][-1]["content"]
    return isinstance(last, list) and last[-1].get("text") == SUMMARY_INSTRUCTION


async def count(stack: ExecStack, stmt: Any) -> int:
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            return int((await conn.execute(stmt)).scalar_one())
    finally:
        await engine.dispose()


async def test_a_long_conversation_is_compacted_as_it_grows(stack: ExecStack) -> None:
    await stack.start_worker()
    tenant = await stack.tenant(agent=agent(BUDGET))
    conversation = f"long-{uuid.uuid4().hex[:8]}"
    texts = [
        f"what time is it now, turn {i}?" if i % 7 == 3 else f"note {i}: the archive holds box {i}"
        for i in range(TURNS)
    ]
    run_ids = await send_all(stack, tenant, texts, conversation)
    await wait_for_status(stack.db_url, run_ids[-1], "completed", timeout=240)
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            statuses = (
                await conn.execute(select(runs.c.status).where(runs.c.run_id.in_(run_ids)))
            ).all()
            compacted = [
                dict(row.payload)
                for row in await conn.execute(
                    select(run_event_log.c.payload).where(
                        run_event_log.c.run_id.in_(run_ids),
                        run_event_log.c.type == "context.compacted",
                    )
                )
            ]
            stored = (
                await conn.execute(
                    select(func.count())
                    .select_from(context_summaries)
                    .where(context_summaries.c.run_id.in_(run_ids))
                )
            ).scalar_one()
            kept = (
                await conn.execute(
                    select(func.count())
                    .select_from(run_parts)
                    .where(run_parts.c.run_id == run_ids[0])
                )
            ).scalar_one()
    finally:
        await engine.dispose()
    assert {row.status for row in statuses} == {"completed"} and len(statuses) == TURNS

    requests = [r for r in stack.model.requests if r.outcome == "ok"]
    main = [r for r in requests if not _instructs(r.body)]
    summaries = [r for r in requests if _instructs(r.body)]
    assert len(main) >= TURNS + TURNS // 7, "a request per turn, two for a tool turn"
    assert len(summaries) >= 3, "the conversation was compacted as it grew"
    over = [input_total(r.usage) for r in main if r.usage and input_total(r.usage) > BUDGET]
    assert not over, f"requests over the budget of {BUDGET}: {over}"
    assert max(input_total(r.usage) for r in main if r.usage) > BUDGET // 2, "it was exercised"
    # Tool calls stay paired with their results in every request.
    for request in main:
        messages = request.body["messages"]
        for i, message in enumerate(messages):
            calls = {b["id"] for b in message["content"] if b.get("type") == "tool_use"}
            if not calls:
                continue
            answered = {
                b["tool_use_id"]
                for b in messages[i + 1]["content"]
                if b.get("type") == "tool_result"
            }
            assert calls <= answered, json.dumps(messages[i : i + 2])[:400]

    assert len(compacted) == len(summaries)
    for event in compacted:
        assert int(event["tokensAfter"]) < int(event["tokensBefore"])
        assert int(event["runsCompacted"]) >= 1 and event["fromRunId"] == run_ids[0]
    assert stored == len(summaries), "one stored summary per compaction"
    assert kept >= 1, "the summarised runs keep their parts, for audit"


async def warmed_up(stack: ExecStack, turns: int) -> tuple[Tenant, str, list[str]]:
    """A conversation of `turns` runs without a budget; then its tenant's agent gets one so
    small that its next run compacts all of them."""
    tenant = await stack.tenant(agent=agent(0))
    conversation = f"kill-{uuid.uuid4().hex[:8]}"
    run_ids = await send_all(
        stack, tenant, [f"note {i} of the box" for i in range(turns)], conversation
    )
    await wait_for_status(stack.db_url, run_ids[-1], "completed", timeout=60)
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                update(tenants)
                .where(tenants.c.tenant_id == tenant.tenant_id)
                .values(agent={**agent(800), "limits": {"backoff_initial_seconds": 0.05}})
            )
    finally:
        await engine.dispose()
    return tenant, conversation, run_ids


async def one_summary(stack: ExecStack, run_id: str) -> None:
    summaries = await count(
        stack,
        select(func.count())
        .select_from(context_summaries)
        .where(context_summaries.c.run_id == run_id),
    )
    parts = await count(
        stack,
        select(func.count())
        .select_from(run_parts)
        .where(run_parts.c.run_id == run_id, run_parts.c.kind == "summary"),
    )
    events = await count(
        stack,
        select(func.count())
        .select_from(run_event_log)
        .where(run_event_log.c.run_id == run_id, run_event_log.c.type == "context.compacted"),
    )
    assert (summaries, parts, events) == (1, 1, 1)


async def pending(stack: ExecStack, key: str) -> bool | None:
    found = [r for r in stack.model.requests if r.script_key == key and r.outcome == "pending"]
    return True if found else None


async def test_a_worker_killed_during_compaction_leaves_one_summary(stack: ExecStack) -> None:
    since = len(stack.model.requests)
    worker = await stack.start_worker()
    tenant, conversation, _ = await warmed_up(stack, 12)
    text = f"and the last box? {uuid.uuid4().hex}"
    stack.model.script(SUMMARY_KEY, [TextTurn("cut", fault=Stall(30.0)), TextTurn("Twelve notes.")])
    stack.model.script(text, [TextTurn("Box twelve.")])
    [run_id] = await send_all(stack, tenant, [text], conversation)
    await eventually(lambda: pending(stack, SUMMARY_KEY), timeout=20, what="a summary")
    stack.services.kill(worker)
    await stack.start_worker()
    run = await wait_for_status(stack.db_url, run_id, "completed", timeout=30)
    assert run.result_text == "Box twelve." and run.attempt == 2
    await one_summary(stack, run_id)
    summary_requests = [r for r in stack.model.requests[since:] if r.script_key == SUMMARY_KEY]
    assert [r.outcome for r in summary_requests] == ["disconnected", "ok"]


async def test_a_worker_killed_after_compaction_leaves_one_summary(stack: ExecStack) -> None:
    since = len(stack.model.requests)
    worker = await stack.start_worker()
    tenant, conversation, _ = await warmed_up(stack, 12)
    text = f"and the last box? {uuid.uuid4().hex}"
    stack.model.script(SUMMARY_KEY, [TextTurn("Twelve notes.")])
    stack.model.script(text, [TextTurn("cut", fault=Stall(30.0)), TextTurn("Box twelve.")])
    [run_id] = await send_all(stack, tenant, [text], conversation)
    await eventually(lambda: pending(stack, text), timeout=20, what="the call after the summary")
    stack.services.kill(worker)
    await stack.start_worker()
    run = await wait_for_status(stack.db_url, run_id, "completed", timeout=30)
    assert run.result_text == "Box twelve." and run.attempt == 2
    await one_summary(stack, run_id)
    assert len([r for r in stack.model.requests[since:] if r.script_key == SUMMARY_KEY]) == 1
    # The recovered attempt sent the stored summary in place of the runs it covers.
    last = [r for r in stack.model.requests if r.script_key == text][-1]
    first_message = json.dumps(last.body["messages"][0])
    assert "Twelve notes." in first_message and "note 0 of the box" not in first_message
    assert (await run_row(stack.db_url, run_id)).status == "completed"
