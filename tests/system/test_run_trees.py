"""Run trees with the services as real processes: a run's `delegate` calls start child runs of
other agents, the parent waits holding no worker and resumes once with every child's answer, and
a worker SIGKILLed mid-delegation leaves exactly one child per call."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from sqlalchemy import func, select

from tests.system.execution_support import (
    ExecStack,
    Tenant,
    events_of,
    exec_stack,
    run_row,
    wait_for_status,
)
from tether import apikeys
from tether.client import TetherClient
from tether.db.engine import create_engine
from tether.db.schema import runs, usage_turns
from tether.testing.eventually import eventually
from tether.testing.model_script import ToolUseBlock
from tether.testing.model_server import BlocksTurn, TextTurn, ToolUseTurn, Usage

# a whole stack of processes per module, and a worker killed and replaced: in `make slow`
pytestmark = pytest.mark.slow


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ExecStack]:
    run_dir = Path(tmp_path_factory.mktemp("trees"))
    # Leases of 6 s, not FAST's 1.5: a machine stalled past a lease's TTL (CI's, under load)
    # lapses the parent's lease before the kill, its children then run in the slot it freed,
    # and the kill tests would no longer test what they name.
    slow_leases = {"TETHER_ORCHESTRATOR_LEASE_TTL_S": "6"}
    async with exec_stack(
        pg_server_url, template_db, redis_url, run_dir, workers=0, extra_env=slow_leases
    ) as running:
        # One slot: a parent that held it while its children ran would never see them start.
        await running.start_worker(TETHER_WORKER_CONCURRENCY="1")
        yield running


def prompt(label: str) -> str:
    return f"{label} {uuid.uuid4().hex}"


def of_type(events: list[tuple[int, str, dict[str, Any]]], kind: str) -> list[dict[str, Any]]:
    return [payload for _, t, payload in events if t == kind]


def tool_results(request: Any) -> list[dict[str, Any]]:
    """The tool_result blocks of a request's last (user) message."""
    last = request.body["messages"][-1]
    return [b for b in last["content"] if isinstance(b, dict) and b.get("type") == "tool_result"]


def result_text(block: dict[str, Any]) -> str:
    content = block["content"]
    if isinstance(content, str):
        return content
    return "".join(c.get("text", "") for c in content)


SCOPES = [*apikeys.CLIENT_SCOPES, apikeys.AGENTS_READ, apikeys.AGENTS_WRITE]


async def announced(tc: TetherClient) -> None:
    """Once the worker's hello announced slow_task (an agent may name only such a tool)."""

    async def listed() -> bool:
        return "slow_task" in {t.name for t in (await tc.list_tools()).tools}

    await eventually(listed, timeout=30, interval=0.05, what="the worker's tools")


async def lead_tenant(stack: ExecStack) -> Tenant:
    """A tenant whose default agent `lead` may delegate to `researcher` (and to itself)."""
    tenant = await stack.tenant(scopes=SCOPES)
    async with TetherClient(stack.addr("gateway"), tenant.api_key) as tc:
        await announced(tc)
        # The first agent applied without routes takes the tenant's runs.
        await tc.apply_agent(json.dumps({"name": "lead", "tools": ["slow_task"]}))
        await tc.apply_agent(json.dumps({"name": "researcher", "tools": ["slow_task"]}))
        await tc.apply_agent(
            json.dumps(
                {
                    "name": "lead",
                    "tools": ["slow_task"],
                    "delegation": {"agents": ["researcher", "lead"]},
                }
            )
        )
    return tenant


async def children_of(stack: ExecStack, run_id: str) -> list[Any]:
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(
                select(runs)
                .where(runs.c.tree_parent_run_id == run_id)
                .order_by(runs.c.created_at, runs.c.run_id)
            )
            return list(rows)
    finally:
        await engine.dispose()


async def tether_cli(stack: ExecStack, tenant: Tenant, *args: str) -> tuple[int, str]:
    """`tether ARGS` as a person runs it, against the stack's gateway with the tenant's key."""
    env = {**os.environ, "TETHER_GATEWAY": stack.addr("gateway"), "TETHER_API_KEY": tenant.api_key}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tether.cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode() + err.decode()


def delegate(tool_id: str, message: str, agent: str = "researcher") -> ToolUseBlock:
    return ToolUseBlock("delegate", {"agent": agent, "message": message}, id=tool_id)


async def test_a_parent_delegating_to_two_children_resumes_once_with_both_answers(
    stack: ExecStack,
) -> None:
    tenant = await lead_tenant(stack)
    text, first, second = prompt("plan the trip"), prompt("find trains"), prompt("find hotels")
    stack.model.script(
        text,
        [
            BlocksTurn([delegate("toolu_a", first), delegate("toolu_b", second)]),
            TextTurn("Trains and hotels are found."),
        ],
    )
    stack.model.script(first, [TextTurn("The 9:12 train.")])
    stack.model.script(second, [TextTurn("Hotel Bristol.")])
    parent_id = await tenant.send(text)

    done = await wait_for_status(stack.db_url, parent_id, "completed", timeout=40)
    assert done.result_text == "Trains and hotels are found."
    children = await children_of(stack, parent_id)
    assert [c.tree_call_id for c in children] == ["toolu_a", "toolu_b"]
    for child, message in zip(children, (first, second), strict=True):
        assert child.status == "completed"
        assert child.input_text == message
        assert (child.tree_root_run_id, child.tree_depth) == (parent_id, 1)
        assert child.tenant_id == done.tenant_id
        assert child.owner_principal_id == done.owner_principal_id
        assert child.session_id != done.session_id, "each child has its own session"
        assert child.agent_name == "researcher"
    assert (done.tree_parent_run_id, done.tree_depth) == (None, 0)

    events = await events_of(stack.db_url, parent_id)
    kinds = [t for _, t, _ in events]
    assert kinds.count("run.started") == 2, "parked once, resumed once"
    assert [e["childRunId"] for e in of_type(events, "child.started")] == [
        c.run_id for c in children
    ]
    (waiting,) = of_type(events, "children.waiting")
    assert waiting["toolCallIds"] == ["toolu_a", "toolu_b"]
    ended = of_type(events, "child.completed")
    assert sorted((e["toolCallId"], e["status"]) for e in ended) == [
        ("toolu_a", "completed"),
        ("toolu_b", "completed"),
    ]
    assert kinds.index("children.waiting") < kinds.index("child.completed")

    asked = [r for r in stack.model.requests if r.script_key == text]
    assert len(asked) == 2, "the parent's model was asked once more, after both children"
    answers = {b["tool_use_id"]: result_text(b) for b in tool_results(asked[-1])}
    assert answers == {"toolu_a": "The 9:12 train.", "toolu_b": "Hotel Bristol."}

    async with TetherClient(stack.addr("gateway"), tenant.api_key) as tc:
        shown = (await tc.get_run(children[0].run_id)).run
        listed = (await tc.list_runs(tree_root_run_id=parent_id)).runs
        other = await lead_tenant(stack)
        async with TetherClient(stack.addr("gateway"), other.api_key) as stranger:
            assert not (await stranger.list_runs(tree_root_run_id=parent_id)).runs
    assert (shown.tree_parent_run_id, shown.tree_root_run_id, shown.tree_depth) == (
        parent_id,
        parent_id,
        1,
    )
    assert sorted(r.run_id for r in listed) == sorted([parent_id, *(c.run_id for c in children)])

    # `tether run CHILD --tree` shows the whole tree from its root, each node's status and spend.
    code, out = await tether_cli(stack, tenant, "run", children[1].run_id, "--tree", "--json")
    assert code == 0, out
    shown_tree = json.loads(out)
    assert shown_tree["root"] == parent_id
    nodes = shown_tree["runs"]
    assert [(n["run_id"], n["depth"], n["status"]) for n in nodes] == [
        (parent_id, 0, "completed"),
        (children[0].run_id, 1, "completed"),
        (children[1].run_id, 1, "completed"),
    ]
    own = [int(n["usage"].get("output_tokens", 0)) for n in nodes]
    assert all(own) and nodes[0]["tree_usage"]["output_tokens"] == sum(own)
    code, out = await tether_cli(stack, tenant, "run", parent_id, "--tree")
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].startswith(f"{parent_id} lead completed in=")
    assert lines[1].startswith(f"  {children[0].run_id} researcher (toolu_a) completed")
    assert " tree: out=" in lines[0]


async def test_a_refused_delegation_is_a_tool_error_the_model_reads_and_nothing_starts(
    stack: ExecStack,
) -> None:
    tenant = await lead_tenant(stack)
    text = prompt("delegate wrongly")
    stack.model.script(
        text,
        [
            BlocksTurn([delegate("toolu_x", "anything", agent="stranger")]),
            TextTurn("I will do it myself."),
        ],
    )
    done = await wait_for_status(stack.db_url, await tenant.send(text), "completed")
    assert await children_of(stack, done.run_id) == []
    events = await events_of(stack.db_url, done.run_id)
    assert not of_type(events, "child.started")
    (failed,) = of_type(events, "tool.failed")
    assert failed["error"]["code"] == "tool_invalid_input"
    (refused,) = tool_results([r for r in stack.model.requests if r.script_key == text][-1])
    assert refused["is_error"] and "may not delegate to 'stranger'" in result_text(refused)


async def test_a_tree_deeper_than_its_limit_is_refused_to_the_model(stack: ExecStack) -> None:
    tenant = await stack.tenant(scopes=SCOPES)
    async with TetherClient(stack.addr("gateway"), tenant.api_key) as tc:
        await tc.apply_agent(
            json.dumps({"name": "lead", "delegation": {"agents": ["lead"], "max_depth": 1}})
        )
    text, inner = prompt("delegate to myself"), prompt("and again")
    stack.model.script(
        text, [BlocksTurn([delegate("toolu_1", inner, "lead")]), TextTurn("outer done")]
    )
    stack.model.script(
        inner, [BlocksTurn([delegate("toolu_2", "too deep", "lead")]), TextTurn("inner done")]
    )
    done = await wait_for_status(stack.db_url, await tenant.send(text), "completed", timeout=40)
    (child,) = await children_of(stack, done.run_id)
    assert child.status == "completed" and child.tree_depth == 1
    assert await children_of(stack, child.run_id) == []
    (refused,) = tool_results([r for r in stack.model.requests if r.script_key == inner][-1])
    assert refused["is_error"] and "at most 1 deep" in result_text(refused)


@pytest.mark.parametrize("ending", ["sigkill", "sigterm"])
async def test_a_worker_sigkilled_after_the_delegate_calls_leaves_exactly_two_children(
    stack: ExecStack, ending: str
) -> None:
    tenant = await lead_tenant(stack)
    text, first, second = prompt("research twice"), prompt("topic one"), prompt("topic two")
    stack.model.script(
        text,
        [
            # Both children are started, then the attempt holds its one slot in slow_task:
            # the worker dies with the two calls recorded and their children made.
            BlocksTurn(
                [
                    delegate("toolu_1", first),
                    delegate("toolu_2", second),
                    ToolUseBlock("slow_task", {"seconds": 60}, id="toolu_slow"),
                ]
            ),
            TextTurn("Both topics are researched."),
        ],
    )
    stack.model.script(first, [TextTurn("one: done")])
    stack.model.script(second, [TextTurn("two: done")])
    parent_id = await tenant.send(text)

    async def both_started() -> bool:
        events = await events_of(stack.db_url, parent_id)
        started = of_type(events, "tool.started")
        return len(of_type(events, "child.started")) == 2 and any(
            e["toolCallId"] == "toolu_slow" for e in started
        )

    await eventually(both_started, timeout=20, interval=0.05, what="two children and slow_task")
    worker = next(name for name in stack.services.procs if name.startswith("worker"))
    if ending == "sigkill":
        stack.services.kill(worker)  # its lease lapses: the reaper requeues the parent
    else:
        await stack.services.stop(worker)  # it hands the parent's lease back, calls closed
    before = await children_of(stack, parent_id)
    killed = await run_row(stack.db_url, parent_id)
    # The module's next tests need a worker whatever this one finds.
    await stack.start_worker(TETHER_WORKER_CONCURRENCY="1")
    assert killed.attempt == 1, "the parent's first lease lapsed before the worker was stopped"
    assert [c.status for c in before] == ["queued", "queued"], "no slot ran them yet"

    done = await wait_for_status(stack.db_url, parent_id, "completed", timeout=60)
    assert done.result_text == "Both topics are researched."
    after = await children_of(stack, parent_id)
    assert [c.run_id for c in after] == [c.run_id for c in before], "never a second child"
    assert [c.status for c in after] == ["completed", "completed"]
    events = await events_of(stack.db_url, parent_id)
    assert len(of_type(events, "child.started")) == 2
    asked = [r for r in stack.model.requests if r.script_key == text]
    answers = {b["tool_use_id"]: result_text(b) for b in tool_results(asked[-1])}
    assert answers["toolu_1"] == "one: done" and answers["toolu_2"] == "two: done"
    assert answers["toolu_slow"].startswith("interrupted")
    failed = [e["toolCallId"] for e in of_type(events, "tool.failed")]
    assert failed == ["toolu_slow"], (
        "only slow_task was closed: the delegate calls were issued again"
    )
    still = await run_row(stack.db_url, parent_id)
    assert still.lease_owner is None


async def slow_task_started(stack: ExecStack, run_id: str) -> None:
    async def started() -> bool:
        events = await events_of(stack.db_url, run_id)
        return any(e["name"] == "slow_task" for e in of_type(events, "tool.started"))

    await eventually(started, timeout=30, interval=0.05, what=f"slow_task to start in {run_id}")


async def test_cancelling_the_root_cancels_its_whole_depth_3_tree_and_no_model_call_follows(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant(scopes=SCOPES)
    async with TetherClient(stack.addr("gateway"), tenant.api_key) as tc:
        await tc.apply_agent(
            json.dumps({"name": "lead", "tools": ["slow_task"], "delegation": {"agents": ["lead"]}})
        )
    texts = [prompt(f"level {depth}") for depth in range(4)]
    for depth, text in enumerate(texts[:-1]):
        stack.model.script(
            text,
            [
                BlocksTurn([delegate(f"toolu_{depth}", texts[depth + 1], "lead")]),
                TextTurn(f"level {depth} must never answer"),
            ],
        )
    stack.model.script(
        texts[-1],
        [
            BlocksTurn([ToolUseBlock("slow_task", {"seconds": 60}, id="toolu_slow")]),
            TextTurn("the deepest must never answer"),
        ],
    )
    root_id = await tenant.send(texts[0])
    tree = [root_id]
    for _ in range(3):

        async def next_child(parent: str = tree[-1]) -> str | None:
            found = await children_of(stack, parent)
            return found[0].run_id if found else None

        tree.append(await eventually(next_child, timeout=30, interval=0.05, what="a child"))
    deepest = tree[-1]
    await slow_task_started(stack, deepest)
    assert [(await run_row(stack.db_url, r)).status for r in tree] == [
        "waiting-for-children",
        "waiting-for-children",
        "waiting-for-children",
        "running",
    ]
    asked_before = len(stack.model.requests)

    assert (await tenant.cancel(root_id)).changed
    for run_id in tree:
        row = await wait_for_status(stack.db_url, run_id, "cancelled", timeout=10)
        assert row.lease_owner is None
    # The deepest run's worker ended it: its slow_task was cut short, not run out.
    deepest_row = await run_row(stack.db_url, deepest)
    asked_at = deepest_row.cancel_requested_at
    assert (deepest_row.finished_at - asked_at).total_seconds() < 1.5, "within one keepalive"
    # A run below that held no worker ended at once, saying why.
    (cancelled,) = of_type(await events_of(stack.db_url, tree[1]), "run.cancelled")
    assert cancelled["reason"] == f"run {root_id}, above it in its tree, was cancelled"
    assert len(stack.model.requests) == asked_before, "no model call started after the cancel"
    for text in texts:
        assert stack.model.pending(text) == 1, "every run's answer is left unasked"
    for run_id in tree[:-1]:
        assert not of_type(await events_of(stack.db_url, run_id), "child.completed")


async def test_a_child_cancelled_alone_is_a_tool_error_its_parent_reads(stack: ExecStack) -> None:
    tenant = await lead_tenant(stack)
    text, task = prompt("delegate a long task"), prompt("a long task")
    stack.model.script(
        text, [BlocksTurn([delegate("toolu_long", task)]), TextTurn("It was cancelled.")]
    )
    stack.model.script(
        task, [ToolUseTurn("slow_task", {"seconds": 60}), TextTurn("must never be said")]
    )
    parent_id = await tenant.send(text)

    async def the_child() -> str | None:
        found = await children_of(stack, parent_id)
        return found[0].run_id if found else None

    child_id = await eventually(the_child, timeout=30, interval=0.05, what="the child")
    await slow_task_started(stack, child_id)
    assert (await tenant.cancel(child_id)).changed
    await wait_for_status(stack.db_url, child_id, "cancelled", timeout=10)
    done = await wait_for_status(stack.db_url, parent_id, "completed", timeout=30)
    assert done.result_text == "It was cancelled."
    (ended,) = of_type(await events_of(stack.db_url, parent_id), "child.completed")
    assert (ended["childRunId"], ended["status"]) == (child_id, "cancelled")
    (result,) = tool_results([r for r in stack.model.requests if r.script_key == text][-1])
    assert result["is_error"]
    assert result_text(result).startswith(f"the child run {child_id} cancelled")


async def tree_output_tokens(stack: ExecStack, run_ids: list[str]) -> int:
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            total = await conn.scalar(
                select(func.coalesce(func.sum(usage_turns.c.output_tokens), 0)).where(
                    usage_turns.c.run_id.in_(run_ids)
                )
            )
            return int(total or 0)
    finally:
        await engine.dispose()


async def test_children_share_what_their_parent_has_left_and_the_tree_stays_in_its_ceiling(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant(scopes=SCOPES)
    async with TetherClient(stack.addr("gateway"), tenant.api_key) as tc:
        await tc.apply_agent(json.dumps({"name": "lead"}))
        await tc.apply_agent(json.dumps({"name": "researcher"}))  # 100,000 output tokens
        await tc.apply_agent(
            json.dumps(
                {
                    "name": "lead",
                    "limits": {"max_output_tokens": 1000},
                    "delegation": {"agents": ["researcher"]},
                }
            )
        )
    text, first, second = prompt("spend freely"), prompt("long essay"), prompt("longer essay")
    # Each turn would write 5,000 tokens if nothing held it back.
    lavish = Usage(input_tokens=10, output_tokens=5000)
    stack.model.script(
        text,
        [
            BlocksTurn(
                [delegate("toolu_a", first), delegate("toolu_b", second)],
                usage=Usage(input_tokens=10, output_tokens=100),
            ),
            TextTurn("Here is what they wrote.", usage=lavish),
        ],
    )
    stack.model.script(first, [TextTurn("essay one", usage=lavish)])
    stack.model.script(second, [TextTurn("essay two", usage=lavish)])
    parent_id = await tenant.send(text)
    done = await wait_for_status(stack.db_url, parent_id, "completed", timeout=40)

    children = await children_of(stack, parent_id)
    # 900 left after the parent's first turn, split between the two, not given to each.
    assert [c.tree_budget["max_output_tokens"] for c in children] == [450, 450]
    for child, key in zip(children, (first, second), strict=True):
        assert child.status == "completed"
        (asked,) = [r for r in stack.model.requests if r.script_key == key]
        assert asked.body["max_tokens"] == 450, "the child's turn is clamped to its share"
        assert child.warnings == ["output_tokens_exceeded", "budget_exhausted"]
    # The parent resumed with its children's spend charged to it: nothing was left.
    last = [r for r in stack.model.requests if r.script_key == text][-1]
    assert last.body["max_tokens"] == 1
    assert done.warnings == ["output_tokens_exceeded", "budget_exhausted"]
    spent = await tree_output_tokens(stack, [parent_id, *(c.run_id for c in children)])
    assert spent <= 1000 + last.body["max_tokens"], "at most one turn's max_tokens past it"
    assert spent == 1001
