"""Prompt caching that survives pauses and retries, with the services as processes: a run with
a tool turn, a provider error and its retry, a question pause and a worker SIGKILLed mid-stream
(its run recovered by another worker) sends every request with the same bytes up to its
breakpoints, and every request after the run's first reads the system prompt and the history
from the local model server's cache, as the server and the run's usage both report."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from sqlalchemy import select

from tests.system.execution_support import ExecStack, exec_stack, wait_for_status
from tether.client import TetherClient
from tether.db.engine import create_engine
from tether.db.schema import usage_turns
from tether.testing.eventually import eventually
from tether.testing.model_cache import blocks_of
from tether.testing.model_server import MidStreamError, Stall, TextTurn, ToolUseTurn

# Slow: a worker SIGKILLed mid-stream, a retry and a pause, in one run (make slow).
pytestmark = pytest.mark.slow

# Instructions long enough that the stable prefix is cacheable (1,024 tokens and more).
PERSONA = {
    "name": "archivist",
    "version": 1,
    "instructions": "You are the archivist. "
    + " ".join(f"Rule {i}: answer from the records and say which record." for i in range(90)),
}
SKILL = {
    "name": "timekeeping",
    "version": 1,
    "instructions": "You tell the time with get_time, and ask before you guess.",
    "tools": ["get_time", "ask_questions"],
}
QUESTION = {
    "questions": [
        {"key": "zone", "prompt": "Which zone?", "options": ["UTC", "local"], "multiple": False}
    ]
}


@pytest_asyncio.fixture(loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path: Path
) -> AsyncIterator[ExecStack]:
    async with exec_stack(pg_server_url, template_db, redis_url, tmp_path, workers=0) as running:
        yield running


def flat(body: dict[str, Any]) -> list[tuple[str, Any]]:
    """The request's blocks in cache order, each with where it is."""
    blocks = [("tools", t) for t in body.get("tools", [])]
    blocks += [("system", b) for b in body["system"]]
    for message in body["messages"]:
        blocks += [(message["role"], b) for b in message["content"]]
    return blocks


def marked_positions(body: dict[str, Any]) -> list[int]:
    """Indexes (in cache order: tools, system, message blocks) of the breakpoints."""
    return [i for i, (_, block) in enumerate(flat(body)) if "cache_control" in block]


def prefix(body: dict[str, Any], through: int) -> str:
    """The request's bytes (as sent: its key order kept) through block `through`."""
    return json.dumps(flat(body)[: through + 1])


def tokens_through(body: dict[str, Any], through: int) -> int:
    return sum(b.tokens for b in blocks_of(body)[: through + 1])


async def test_the_prefix_holds_and_is_read_across_tools_retries_pauses_and_recovery(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant(agent={"persona": PERSONA, "skills": [SKILL], "tool_allowlist": []})
    conversation = f"c-{uuid.uuid4().hex[:8]}"
    first = f"remember the archive {uuid.uuid4().hex}"
    worker = await stack.start_worker()
    # Every request of the conversation is keyed by its first message.
    stack.model.script(first, [TextTurn("Noted.")])
    await wait_for_status(stack.db_url, await tenant.send(first, conversation), "completed")
    stack.model.script(
        first,
        [
            ToolUseTurn("get_time", {}),  # a tool turn
            TextTurn("It is", fault=MidStreamError(after_events=3)),  # a provider error: retried
            ToolUseTurn("ask_questions", QUESTION),  # a question pause
            TextTurn("Let me think", fault=Stall(30.0)),  # the worker dies mid-stream
            TextTurn("Noon, UTC."),  # the recovered attempt, on another worker
        ],
    )
    run_id = await tenant.send("what time is it in the archive?", conversation)
    await wait_for_status(stack.db_url, run_id, "waiting-for-question")
    async with TetherClient(stack.addr("gateway"), tenant.api_key) as client:
        assert (await client.answer(run_id, {"zone": ["UTC"]})).resumed

    async def stalled() -> bool | None:
        last = [r for r in stack.model.requests if r.script_key == first]
        return True if len(last) == 5 and last[-1].outcome == "pending" else None

    await eventually(stalled, timeout=20, what="the attempt streaming after the answer")
    stack.services.kill(worker)
    await stack.start_worker()
    run = await wait_for_status(stack.db_url, run_id, "completed", timeout=30)
    assert run.result_text == "Noon, UTC."
    # Attempts: the tool turn and the error; the retry (the question, then the answer's resume
    # on a new lease); the recovery.
    assert run.attempt == 3

    recorded = [r for r in stack.model.requests if r.script_key == first]
    assert len(recorded) == 6, "the first run's, then the tool turn, the error, the retry's "
    "question, the answer's stream cut by the kill, the recovered answer"
    earlier, requests = recorded[0], recorded[1:]
    bodies = [r.body for r in requests]
    # Breakpoint 1 ends the system prompt, breakpoint 2 the history; both hold their place and
    # their bytes in every request of the run, whichever attempt and worker sent it.
    marks = [marked_positions(b) for b in bodies]
    system_end, history_end = marks[0][:2]
    assert all(m[:2] == [system_end, history_end] for m in marks), marks
    assert len({prefix(b, system_end) for b in bodies}) == 1
    assert len({prefix(b, history_end) for b in bodies}) == 1
    assert prefix(earlier.body, system_end) == prefix(bodies[0], system_end)
    # The live facts (the time) come after both, never inside the cached prefix.
    for body in bodies:
        facts = [i for i, (_, block) in enumerate(flat(body)) if "<live_facts>" in str(block)]
        assert len(facts) == 1 and facts[0] > history_end
    stable = tokens_through(bodies[0], history_end)
    assert tokens_through(bodies[0], system_end) >= 1024, "the stable prefix is cacheable"

    # Every request after the conversation's first reads the cache; after the run's first, at
    # least the system prompt and the history.
    reads = [r.usage["cache_read_input_tokens"] for r in requests if r.usage]
    assert len(reads) == len(requests), "every request was answered with its usage"
    assert reads[0] >= tokens_through(bodies[0], system_end)
    assert all(read >= stable for read in reads[1:]), (reads, stable)

    # The run's usage records the same reads, turn by turn (the turns that finished).
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            turns = (
                await conn.execute(
                    select(usage_turns.c.cache_read_input_tokens)
                    .where(usage_turns.c.run_id == run_id)
                    .order_by(usage_turns.c.id)
                )
            ).all()
    finally:
        await engine.dispose()
    recorded_reads = [t.cache_read_input_tokens for t in turns]
    assert len(recorded_reads) == 3, "tool turn, question, answer"
    assert recorded_reads[0] == reads[0]
    assert all(read >= stable for read in recorded_reads[1:])
    assert run.usage["cache_read_input_tokens"] == sum(recorded_reads)
