"""An accepted cancel always ends the run cancelled, whatever it races; a cancel hint on Redis is
never an authority. Services run as real processes.

Each race is held open deterministically: the test locks the run row (SELECT ... FOR UPDATE in
an open transaction), so every write to it queues in arrival order; it lines the racers up (the
worker's last checkpoint before its move, then the cancel request, or the cancel first and then
the completion) and lets them go. The race workers run without Redis and with keepalives far
apart, so they learn of a cancel from a checkpoint's answer or from the cancel their replica
pushes on the Work stream, never before the race is let go.

The reap race (a cancel accepted while the run's worker is dead) is
tests/system/test_drills.py::test_a_cancelled_run_whose_worker_died_is_finalised_by_the_orchestrator.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import redis.asyncio as redis

from tests.system.execution_support import (
    ExecStack,
    Tenant,
    events_of,
    exec_stack,
    parts_of,
    run_row,
    wait_for_status,
)
from tests.system.row_hold import CHECKPOINT, RowHold
from tether.hints import cancel_channel
from tether.testing.eventually import eventually
from tether.testing.model_server import MidStreamError, TextTurn, ToolUseTurn

# processes killed and restarted, services outlived: seconds each, so in `make slow` (the budget)
pytestmark = pytest.mark.slow


# Leases outlive every test here: no keepalive or reap may interleave with a held race.
LONG_LEASE = {
    "TETHER_ORCHESTRATOR_LEASE_TTL_S": "60",
    "TETHER_ORCHESTRATOR_KEEPALIVE_INTERVAL_S": "30",
}
RACE_WORKER = {
    "TETHER_REDIS_URL": "",
    "TETHER_WORKER_CHECKPOINT_INTERVAL_S": "30",
}
# What the queued statements look like (pg_stat_activity.query).
# The cancel request reads the run under a row lock before it writes anything.
CANCEL = "SELECT runs.run_id, runs.tenant_id"
PARK = "waiting_interaction_id="  # the park sets it
# The completion's statement: its fence reads the run under a lock (a checkpoint's fence is an
# UPDATE). pg_stat_activity keeps a query's first 1024 bytes (track_activity_query_size), and
# the call to tether_complete_run now starts past them, after the run's every column: so the
# fence's own words tell it apart.
COMPLETION = "(SELECT runs.cancel_requested_at AS cancel_requested_at, runs.checkpoint_batch"
HOLD = "FOR NO KEY UPDATE"
SETTLED = ("cancelled", "completed", "failed", "queued", "retry-pending", "waiting-for-approval")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ExecStack]:
    async with exec_stack(
        pg_server_url,
        template_db,
        redis_url,
        Path(tmp_path_factory.mktemp("cancel-races")),
        workers=0,
        extra_env=LONG_LEASE,
    ) as running:
        yield running


def prompt(label: str) -> str:
    return f"{label} {uuid.uuid4().hex}"


async def model_called(stack: ExecStack, key: str, count: int = 1) -> None:
    async def probe() -> bool:
        return len([r for r in stack.model.requests if r.script_key == key]) >= count

    await eventually(probe, what=f"{count} model call(s) for {key!r}")


async def cancel_in_line(tenant: Tenant, run_id: str) -> asyncio.Task[Any]:
    return asyncio.create_task(tenant.cancel(run_id))


async def cancel_behind_the_checkpoint(
    stack: ExecStack, tenant: Tenant, run_id: str
) -> asyncio.Task[Any]:
    """Hold the row until the worker's next checkpoint waits on it, queue the cancel behind
    that checkpoint, and let both go: the checkpoint answers "no cancel", then the flag lands."""
    async with RowHold(stack.db_url, run_id) as hold:
        await hold.lined_up(CHECKPOINT)
        cancel = await cancel_in_line(tenant, run_id)
        await hold.lined_up(CHECKPOINT, CANCEL)
    return cancel


async def settled(stack: ExecStack, run_id: str, timeout: float = 20.0) -> Any:
    return await wait_for_status(stack.db_url, run_id, *SETTLED, timeout=timeout)


async def accepted_cancel_ended_cancelled(
    stack: ExecStack, run_id: str, cancel: asyncio.Task[Any], extra: Sequence[str] = ()
) -> Any:
    response = await asyncio.wait_for(cancel, 20)
    assert response.changed, "the cancel was accepted"
    run = await wait_for_status(stack.db_url, run_id, "cancelled", *extra, *SETTLED[1:])
    assert run.status == "cancelled", f"an accepted cancel ended the run {run.status}"
    assert run.error["code"] == "cancelled"
    assert run.cancel_requested_at is not None, "the request is kept on the finished run"
    return run


async def test_a_cancel_accepted_just_before_a_park_ends_the_run_cancelled(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant()
    text_ = prompt("park race")
    chunks = ['{"text": ', '"We launch', ' today"}']
    call = ToolUseTurn(
        "publish_post", {"text": "We launch today"}, json_chunks=chunks, delay_ms=300
    )
    stack.model.script(text_, [call])
    worker = await stack.start_worker(**RACE_WORKER)
    try:
        run_id = await tenant.send(text_)
        await model_called(stack, text_)
        # The approval is stored; the checkpoint before the park waits on the row.
        cancel = await cancel_behind_the_checkpoint(stack, tenant, run_id)
        # The checkpoint answers "no cancel", the flag commits, then the worker parks.
        await accepted_cancel_ended_cancelled(stack, run_id, cancel)
        types = [t for _, t, _ in await events_of(stack.db_url, run_id)]
        assert types[-1] == "run.cancelled"
        results = [p for p in await parts_of(stack.db_url, run_id) if p.kind == "tool_result"]
        assert len(results) == 1 and results[0].payload["content"].startswith("interrupted")
    finally:
        stack.services.kill(worker)


async def test_a_cancel_requested_just_after_a_park_ends_the_run_cancelled(
    stack: ExecStack,
) -> None:
    """The park lands between the cancel's first read (the run still running) and its write: the
    cancel must see the parked run, not answer "unchanged" and leave it waiting."""
    tenant = await stack.tenant()
    text_ = prompt("park first")
    call = ToolUseTurn("publish_post", {"text": "We launch today"}, delay_ms=300)
    stack.model.script(text_, [call])
    worker = await stack.start_worker(**RACE_WORKER)
    try:
        run_id = await tenant.send(text_)
        await model_called(stack, text_)
        async with (
            RowHold(stack.db_url, run_id) as first,
            RowHold(stack.db_url, run_id, take=False) as second,
        ):
            # The checkpoint before the park waits on the first hold, the second hold behind it:
            # once the checkpoint lands the second hold has the row before the park arrives.
            await first.lined_up(CHECKPOINT)
            taking = asyncio.create_task(second.take())
            await first.lined_up(CHECKPOINT, HOLD)
            await first.release()
            await taking
            await second.lined_up(PARK)
            cancel = await cancel_in_line(tenant, run_id)
            await second.lined_up(PARK, CANCEL)
        await accepted_cancel_ended_cancelled(stack, run_id, cancel)
        types = [t for _, t, _ in await events_of(stack.db_url, run_id)]
        assert types[-2:] == ["approval.requested", "run.cancelled"], "parked, then cancelled"
    finally:
        stack.services.kill(worker)


async def test_a_cancel_accepted_just_before_a_retry_ends_the_run_cancelled(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant()
    text_ = prompt("retry race")
    words = [f"r{i} " for i in range(6)]
    stack.model.script(
        text_,
        [
            TextTurn(
                "".join(words), chunks=words, delay_ms=300, fault=MidStreamError(after_events=4)
            ),
            TextTurn("the retry ran anyway"),
        ],
    )
    worker = await stack.start_worker(**RACE_WORKER)
    try:
        run_id = await tenant.send(text_)
        await model_called(stack, text_)
        # The stream broke; the checkpoint before the retry waits on the row.
        cancel = await cancel_behind_the_checkpoint(stack, tenant, run_id)
        run = await accepted_cancel_ended_cancelled(stack, run_id, cancel)
        assert run.attempt == 1, "never retried"
        assert len([r for r in stack.model.requests if r.script_key == text_]) == 1
    finally:
        stack.services.kill(worker)


async def test_a_cancel_accepted_just_before_a_graceful_release_ends_the_run_cancelled(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant()
    text_ = prompt("release race")
    words = [f"s{i} " for i in range(300)]
    stack.model.script(text_, [TextTurn("".join(words), chunks=words, delay_ms=30)])
    worker = await stack.start_worker(**RACE_WORKER, TETHER_WORKER_GRACE_S="3")
    run_id = await tenant.send(text_)
    await model_called(stack, text_)
    async with RowHold(stack.db_url, run_id) as hold:
        # SIGTERM: past the grace the attempt is stopped and its checkpoint before the release
        # waits on the row (the worker gives it half the grace to land).
        stopping = asyncio.create_task(stack.services.stop(worker, grace=15))
        await hold.lined_up(CHECKPOINT)
        cancel = await cancel_in_line(tenant, run_id)
        await hold.lined_up(CHECKPOINT, CANCEL)
    assert await stopping == 0
    await accepted_cancel_ended_cancelled(stack, run_id, cancel)
    released = [p for _, t, p in await events_of(stack.db_url, run_id) if t == "run.queued"]
    assert [p.get("reason") for p in released] == ["admitted"], "never back in the queue"


async def test_a_cancel_accepted_before_a_completion_lands_ends_the_run_cancelled(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant()
    text_ = prompt("completion race")
    words = [f"c{i} " for i in range(4)]
    stack.model.script(text_, [TextTurn("".join(words), chunks=words, delay_ms=400)])
    worker = await stack.start_worker(**RACE_WORKER)
    try:
        run_id = await tenant.send(text_)
        await model_called(stack, text_)
        async with RowHold(stack.db_url, run_id) as hold:
            # The cancel queues first, while the answer still streams; the completion after it.
            cancel = await cancel_in_line(tenant, run_id)
            await hold.lined_up(CANCEL)
            await hold.lined_up(CANCEL, COMPLETION)
        run = await accepted_cancel_ended_cancelled(stack, run_id, cancel)
        assert run.result_text is None, "the completion did not land"
        parts = await parts_of(stack.db_url, run_id)
        assert [p.payload.get("text") for p in parts] == ["".join(words)], "its parts did"
    finally:
        stack.services.kill(worker)


async def test_a_forged_cancel_hint_on_redis_does_not_cancel_a_run(
    stack: ExecStack, redis_url: str
) -> None:
    tenant = await stack.tenant()
    text_ = prompt("forged hint")
    words = [f"f{i} " for i in range(30)]
    stack.model.script(text_, [TextTurn("".join(words), chunks=words, delay_ms=40)])
    worker = await stack.start_worker()  # with Redis: it listens for cancel hints
    try:
        run_id = await tenant.send(text_)
        await model_called(stack, text_)
        client = redis.Redis.from_url(redis_url)
        try:
            heard = await client.publish(cancel_channel(run_id), "cancelled")
        finally:
            await client.aclose()
        assert heard >= 1, "the worker was listening"
        run = await settled(stack, run_id)
        assert run.status == "completed", f"a forged hint ended the run {run.status}"
        assert run.result_text == "".join(words)
        assert (await run_row(stack.db_url, run_id)).cancel_requested_at is None
    finally:
        stack.services.kill(worker)
