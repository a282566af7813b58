"""Durable timers with the services as real processes: a run's `wait_until` parks it holding no
worker, the orchestrator wakes it once when due (across a replica's SIGKILL too), the model reads
when it woke, and a cancel ends the wait for good."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from sqlalchemy import select

from tests.system.execution_support import (
    TOOLS,
    ExecStack,
    Tenant,
    events_of,
    exec_stack,
    parts_of,
    run_row,
    wait_for_status,
)
from tether.client import TetherClient
from tether.db.engine import create_engine
from tether.db.schema import run_event_log
from tether.testing.model_server import TextTurn, ToolUseTurn
from tether.v1 import common_pb2

# a whole stack of processes per module: tens of seconds, so in `make slow` (the 15-minute budget)
pytestmark = pytest.mark.slow


AGENT = {"tool_allowlist": [*TOOLS, "wait_until"]}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ExecStack]:
    run_dir = Path(tmp_path_factory.mktemp("timers"))
    async with exec_stack(pg_server_url, template_db, redis_url, run_dir, workers=0) as running:
        # One slot: a run that held it while waiting would keep every other run from starting.
        await running.start_worker(TETHER_WORKER_CONCURRENCY="1")
        yield running


def prompt(label: str) -> str:
    return f"{label} {uuid.uuid4().hex}"


def at(iso: str) -> datetime:
    return datetime.fromisoformat(iso)


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


async def timer_events_committed_at(stack: ExecStack, run_id: str, kind: str) -> list[datetime]:
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(
                select(run_event_log.c.created_at).where(
                    run_event_log.c.run_id == run_id, run_event_log.c.type == kind
                )
            )
            return [r.created_at for r in rows]
    finally:
        await engine.dispose()


async def parked_on_timer(stack: ExecStack, tenant: Tenant, text: str) -> Any:
    run_id = await tenant.send(text)
    return await wait_for_status(stack.db_url, run_id, "waiting-for-timer")


async def test_a_waiting_run_wakes_once_when_due_and_the_model_reads_when_it_woke(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant(agent=AGENT)
    text = prompt("check the repair again in two seconds")
    stack.model.script(
        text, [ToolUseTurn("wait_until", {"seconds": 2}), TextTurn("The repair is done.")]
    )
    parked = await parked_on_timer(stack, tenant, text)
    assert parked.lease_owner is None and parked.next_wake_at is not None
    (set_,) = of_type(await events_of(stack.db_url, parked.run_id), "timer.set")
    assert at(set_["dueAt"]) == parked.next_wake_at
    async with TetherClient(stack.addr("gateway"), tenant.api_key) as tc:
        shown = (await tc.get_run(parked.run_id)).run
    assert shown.status == common_pb2.RUN_STATUS_WAITING_FOR_TIMER
    assert shown.next_wake_at.ToDatetime(UTC) == parked.next_wake_at

    done = await wait_for_status(stack.db_url, parked.run_id, "completed", timeout=30)
    assert done.result_text == "The repair is done." and done.next_wake_at is None
    events = await events_of(stack.db_url, parked.run_id)
    (fired,) = of_type(events, "timer.fired")
    assert fired["dueAt"] == set_["dueAt"]
    (fired_at,) = await timer_events_committed_at(stack, parked.run_id, "timer.fired")
    assert fired_at >= parked.next_wake_at, "never before it was due"
    kinds = [t for _, t, _ in events]
    assert kinds.count("run.started") == 2, "parked once, resumed once"
    assert kinds.index("timer.set") < kinds.index("timer.fired")

    asked = [r for r in stack.model.requests if r.script_key == text]
    assert len(asked) == 2
    (woke,) = tool_results(asked[-1])
    words = result_text(woke)
    assert words.startswith("woke at ") and f"(due {set_['dueAt']})" in words
    assert at(words.split()[2]) >= parked.next_wake_at.replace(microsecond=0)
    (marker,) = [p for p in await parts_of(stack.db_url, parked.run_id) if p.kind == "timer"]
    assert marker.payload == {"toolCallId": woke["tool_use_id"], "dueAt": set_["dueAt"]}


async def test_a_run_waiting_for_its_timer_holds_no_worker(stack: ExecStack) -> None:
    tenant = await stack.tenant(agent=AGENT)
    text = prompt("check again in an hour")
    stack.model.script(text, [ToolUseTurn("wait_until", {"seconds": 3600}), TextTurn("never")])
    parked = await parked_on_timer(stack, tenant, text)
    # The worker has one slot: another conversation can run only if the waiting run left it.
    other = prompt("meanwhile")
    stack.model.script(other, [TextTurn("done meanwhile")])
    meanwhile = await wait_for_status(stack.db_url, await tenant.send(other), "completed")
    assert meanwhile.result_text == "done meanwhile"
    still = await run_row(stack.db_url, parked.run_id)
    assert (still.status, still.lease_owner) == ("waiting-for-timer", None)
    assert (await tenant.cancel(parked.run_id)).changed


@pytest.mark.parametrize(
    ("input", "words"),
    [
        ({"seconds": 5, "until": "2030-01-01T00:00:00Z"}, "exactly one of"),
        ({}, "exactly one of"),
        ({"until": "2020-01-01T00:00:00Z"}, "not in the future"),
        ({"seconds": 120}, "at most 60"),
    ],
)
async def test_a_wait_refused_is_a_tool_error_the_model_reads_and_nothing_is_parked(
    stack: ExecStack, input: dict[str, Any], words: str
) -> None:
    tenant = await stack.tenant(agent=AGENT, max_wait_seconds=60)
    text = prompt("wait wrongly")
    stack.model.script(text, [ToolUseTurn("wait_until", input), TextTurn("I could not wait.")])
    done = await wait_for_status(stack.db_url, await tenant.send(text), "completed")
    events = await events_of(stack.db_url, done.run_id)
    assert not of_type(events, "timer.set") and done.next_wake_at is None
    (failed,) = of_type(events, "tool.failed")
    assert failed["error"]["code"] == "tool_invalid_input"
    (refused,) = tool_results([r for r in stack.model.requests if r.script_key == text][-1])
    assert refused["is_error"] and words in result_text(refused)


async def test_cancelling_a_run_waiting_for_its_timer_ends_it_and_nothing_wakes_it(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant(agent=AGENT)
    text = prompt("wait then be cancelled")
    stack.model.script(
        text, [ToolUseTurn("wait_until", {"seconds": 2}), TextTurn("must never be said")]
    )
    parked = await parked_on_timer(stack, tenant, text)
    assert (await tenant.cancel(parked.run_id)).changed
    gone = await run_row(stack.db_url, parked.run_id)
    assert gone.status == "cancelled" and gone.next_wake_at is None
    (result,) = [p for p in await parts_of(stack.db_url, parked.run_id) if p.kind == "tool_result"]
    assert result.payload["isError"] and "cancelled" in result.payload["content"]

    # Past its due time, a later timer in the same stack fires: the waker has looked since.
    later = prompt("a later timer")
    stack.model.script(later, [ToolUseTurn("wait_until", {"seconds": 3}), TextTurn("later")])
    woke = await parked_on_timer(stack, tenant, later)
    assert woke.next_wake_at > parked.next_wake_at
    await wait_for_status(stack.db_url, woke.run_id, "completed", timeout=30)
    events = await events_of(stack.db_url, parked.run_id)
    assert not of_type(events, "timer.fired")
    assert [t for _, t, _ in events][-1] == "run.cancelled"
    assert (await run_row(stack.db_url, parked.run_id)).status == "cancelled"
    assert len([r for r in stack.model.requests if r.script_key == text]) == 1


@pytest_asyncio.fixture(loop_scope="session")
async def replicas(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path: Path
) -> AsyncIterator[ExecStack]:
    async with exec_stack(pg_server_url, template_db, redis_url, tmp_path, workers=0) as running:
        yield running


@pytest.mark.slow  # two orchestrator replicas, one SIGKILLed and restarted: about 15 s
async def test_a_timer_fires_once_across_a_replica_sigkill_with_a_second_replica_running(
    replicas: ExecStack,
) -> None:
    second = await replicas.services.start("orchestrator")
    both = f"ipv4:{replicas.addr('orchestrator')},{second.address}"
    worker = await replicas.start_worker(TETHER_ORCHESTRATOR_ADDR=both)
    tenant = await replicas.tenant(agent=AGENT)
    text = prompt("wait five seconds across a crash")
    replicas.model.script(text, [ToolUseTurn("wait_until", {"seconds": 5}), TextTurn("awake")])
    parked = await parked_on_timer(replicas, tenant, text)
    # The worker's Work stream (pick-first) is on the first replica, which took the park and
    # whose waker was nudged to fire it: that one dies, the second must fire it.
    replicas.services.kill("orchestrator")
    assert datetime.now(UTC) < parked.next_wake_at, "killed before the timer was due"
    # Back as a supervisor would bring it: two replicas' wakers race for the one timer.
    await replicas.services.restart("orchestrator")
    done = await wait_for_status(replicas.db_url, parked.run_id, "completed", timeout=40)
    assert done.result_text == "awake"
    events = await events_of(replicas.db_url, parked.run_id)
    assert len(of_type(events, "timer.set")) == 1
    assert len(of_type(events, "timer.fired")) == 1, "fired once"
    assert [seq for seq, _, _ in events] == list(range(1, len(events) + 1))
    (fired_at,) = await timer_events_committed_at(replicas, parked.run_id, "timer.fired")
    assert fired_at >= parked.next_wake_at
    asked = [r for r in replicas.model.requests if r.script_key == text]
    assert len(asked) == 2, "the model was asked once before the wait and once after"
    assert result_text(tool_results(asked[-1])[0]).startswith("woke at ")
    log = replicas.services.procs[worker].log_path.read_text()
    assert "Work stream ended" in log, "the park went through the replica that was killed"
