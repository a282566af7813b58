"""Drills of the Work stream with real workers: an orchestrator replica SIGKILLed under the streams
of its workers, two replicas leasing from one queue, and an attempt that hangs past its
progress deadline."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from sqlalchemy import func, update

from tests.system.execution_support import (
    ExecStack,
    events_of,
    exec_stack,
    parts_of,
    run_row,
    wait_for_status,
)
from tether.db.engine import create_engine
from tether.db.schema import runs
from tether.testing.eventually import eventually
from tether.testing.model_server import Stall, TextTurn

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROGRESS_DEADLINE_S = 1.5


@pytest_asyncio.fixture(loop_scope="session")
async def drill(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path: Path
) -> AsyncIterator[ExecStack]:
    async with exec_stack(pg_server_url, template_db, redis_url, tmp_path, workers=0) as stack:
        yield stack


@pytest_asyncio.fixture(loop_scope="session")
async def impatient(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path: Path
) -> AsyncIterator[ExecStack]:
    """A stack whose attempts may go without progress for PROGRESS_DEADLINE_S only."""
    settings = {"TETHER_ORCHESTRATOR_PROGRESS_DEADLINE_S": str(PROGRESS_DEADLINE_S)}
    async with exec_stack(
        pg_server_url, template_db, redis_url, tmp_path, workers=0, extra_env=settings
    ) as stack:
        yield stack


def prompt(label: str) -> str:
    return f"{label} {uuid.uuid4().hex}"


async def streaming(drill: ExecStack, run_id: str) -> None:
    async def checkpointed() -> bool:
        parts = await parts_of(drill.db_url, run_id)
        return bool(parts and len(parts[0].payload.get("text", "")) > 20)

    await eventually(checkpointed, what=f"{run_id} to stream")


def started(events: list[tuple[int, str, dict[str, object]]]) -> int:
    return sum(1 for _, kind, _ in events if kind == "run.started")


@pytest.mark.slow  # two orchestrator replicas, one SIGKILLed mid-stream: a quarter minute
async def test_a_replica_killed_under_its_workers_streams_loses_no_lease_and_no_cancel(
    drill: ExecStack,
) -> None:
    """Workers reconnect to the second replica, announce their leases and finish their
    attempts under the same epochs: nothing is claimed twice, every write stays fenced, and a
    cancel requested while the replica was gone still lands."""
    second = await drill.services.start("orchestrator")
    both = f"ipv4:{drill.addr('orchestrator')},{second.address}"
    tenant = await drill.tenant()
    texts = [prompt("replica dies"), prompt("cancel me meanwhile")]
    words = [f"w{i} " for i in range(250)]
    for text in texts:
        drill.model.script(text, [TextTurn("".join(words), chunks=words, delay_ms=20)])
    worker = await drill.start_worker(TETHER_ORCHESTRATOR_ADDR=both)
    finished, cancelled = [await tenant.send(text) for text in texts]
    for run_id in (finished, cancelled):
        await streaming(drill, run_id)
    epochs = {r: (await run_row(drill.db_url, r)).lease_epoch for r in (finished, cancelled)}
    drill.services.kill("orchestrator")
    # What RequestCancellation writes for a running run: the durable flag (no hint can come:
    # the replica that would publish it is the one that died).
    engine = create_engine(drill.db_url, pool_size=1)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                update(runs)
                .where(runs.c.run_id == cancelled)
                .values(cancel_requested_at=func.now())
            )
    finally:
        await engine.dispose()
    done = await wait_for_status(drill.db_url, finished, "completed", timeout=30)
    gone = await wait_for_status(drill.db_url, cancelled, "cancelled", timeout=30)
    assert (done.attempt, done.lease_epoch) == (1, epochs[finished]), "the same lease, carried on"
    assert (gone.attempt, gone.lease_epoch) == (1, epochs[cancelled])
    assert done.result_text == "".join(words)
    for run_id in (finished, cancelled):
        events = await events_of(drill.db_url, run_id)
        assert started(events) == 1, "leased once"
        assert [seq for seq, _, _ in events] == list(range(1, len(events) + 1))
    log = drill.services.procs[worker].log_path.read_text()
    assert "Work stream ended" in log and "lease lost" not in log


@pytest.mark.slow  # two replicas, each with its own workers, under load: a quarter minute
async def test_two_replicas_with_their_own_workers_lease_each_run_once(drill: ExecStack) -> None:
    second = await drill.services.start("orchestrator")
    await drill.start_worker()  # on the first replica
    await drill.start_worker(TETHER_ORCHESTRATOR_ADDR=second.address)
    tenant = await drill.tenant()
    run_ids = await asyncio.gather(*(tenant.send(prompt("one queue")) for _ in range(30)))
    for run_id in run_ids:
        row = await wait_for_status(drill.db_url, run_id, "completed", timeout=60)
        assert row.attempt == 1
        assert started(await events_of(drill.db_url, run_id)) == 1, "one lease per run"
    workers = {
        payload["workerId"]
        for run_id in run_ids
        for _, kind, payload in await events_of(drill.db_url, run_id)
        if kind == "run.started"
    }
    assert len(workers) == 2, f"both replicas pushed leases to their workers: {workers}"


async def test_an_attempt_without_progress_past_its_deadline_is_cancelled_and_retried(
    impatient: ExecStack,
) -> None:
    drill = impatient
    tenant = await drill.tenant()
    text = prompt("hang")
    drill.model.script(
        text,
        [
            TextTurn("a start, then nothing", fault=Stall(after_events=4)),  # until abandoned
            TextTurn("The second attempt answers."),
        ],
    )
    await drill.start_worker()
    run_id = await tenant.send(text)
    row = await wait_for_status(drill.db_url, run_id, "completed", timeout=30)
    assert (row.attempt, row.result_text) == (2, "The second attempt answers.")
    pending = [
        p for _, kind, p in await events_of(drill.db_url, run_id) if kind == "run.retry-pending"
    ]
    assert [p["error"]["code"] for p in pending] == ["no_progress"]
