"""Failure drills done for real: SIGKILL a worker mid-stream and mid-tool, race two claimers,
write with a stale epoch, SIGTERM a worker mid-run. Each drill gets its own stack."""

from __future__ import annotations

import asyncio
import signal
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from sqlalchemy import func, select

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
from tether.runtime.rpc import internal_channel
from tether.testing.eventually import eventually
from tether.testing.model_server import TextTurn, ToolUseTurn
from tether.v1 import common_pb2, events_pb2, orchestrator_pb2, orchestrator_pb2_grpc

# processes killed and restarted, services outlived: seconds each, so in `make slow` (the budget)
pytestmark = pytest.mark.slow


@pytest_asyncio.fixture(loop_scope="session")
async def drill(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path: Path
) -> AsyncIterator[ExecStack]:
    async with exec_stack(pg_server_url, template_db, redis_url, tmp_path, workers=0) as stack:
        yield stack


def prompt(label: str) -> str:
    return f"{label} {uuid.uuid4().hex}"


async def streaming_on_first_worker(
    drill: ExecStack, label: str, *, words: int, delay_ms: int, then: str
) -> tuple[str, str, str]:
    """A run streaming a long answer on a first worker (the next attempt answers `then`), once
    more than 20 characters of it are checkpointed: (worker, run id, the persisted text)."""
    tenant = await drill.tenant()
    text = prompt(label)
    chunks = [f"{label[0]}{i} " for i in range(words)]
    drill.model.script(
        text, [TextTurn("".join(chunks), chunks=chunks, delay_ms=delay_ms), TextTurn(then)]
    )
    first = await drill.start_worker()
    run_id = await tenant.send(text)

    async def checkpointed_text() -> str | None:
        parts = await parts_of(drill.db_url, run_id)
        value = parts[0].payload.get("text", "") if parts else ""
        return value if len(value) > 20 else None

    persisted = await eventually(checkpointed_text, what="a checkpoint of streamed text")
    return first, run_id, persisted


async def test_sigkill_mid_stream_resumes_on_another_worker_losing_no_persisted_part(
    drill: ExecStack,
) -> None:
    first, run_id, persisted = await streaming_on_first_worker(
        drill, "kill me while streaming", words=300, delay_ms=30, then="Recovered answer."
    )
    drill.services.kill(first)
    await drill.start_worker()
    run = await wait_for_status(drill.db_url, run_id, "completed", timeout=30)
    assert run.attempt == 2
    assert run.result_text == "Recovered answer."
    parts = await parts_of(drill.db_url, run_id)
    assert parts[0].payload["text"].startswith(persisted), "the persisted part survived"
    assert parts[-1].payload["text"] == "Recovered answer."
    queued = [p for _, t, p in await events_of(drill.db_url, run_id) if t == "run.queued"]
    assert queued[-1] == {"attempt": 2, "reason": "lease_expired"}


async def test_sigkill_mid_tool_fires_the_external_side_effect_exactly_once(
    drill: ExecStack,
) -> None:
    tenant = await drill.tenant(grant=["publish_post"])
    text = prompt("publish launch post")
    drill.model.script(
        text,
        [
            ToolUseTurn("publish_post", {"text": "We launch today"}),
            # Attempt 2: the model sees the interrupted call and asks again, same arguments.
            ToolUseTurn("publish_post", {"text": "We launch today"}),
            # And once more, in the same run: the done record answers, nothing fires.
            ToolUseTurn("publish_post", {"text": "We launch today"}),
            TextTurn("Published."),
        ],
    )
    drill.ledger.respond.clear()  # the post lands, the worker never hears back
    first = await drill.start_worker()
    run_id = await tenant.send(text)
    await asyncio.wait_for(drill.ledger.recorded.wait(), 20)
    drill.services.kill(first)
    drill.ledger.respond.set()
    await drill.start_worker()
    run = await wait_for_status(drill.db_url, run_id, "completed", timeout=30)
    assert run.result_text == "Published."
    records = drill.ledger.records
    assert len(records) == 1, "the post was published exactly once"
    key = records[0].key
    assert key is not None and drill.ledger.deliveries(key) == 2, "re-fired once, deduplicated"
    results = [p.payload for p in await parts_of(drill.db_url, run_id) if p.kind == "tool_result"]
    assert results[0]["isError"] and results[0]["content"].startswith("interrupted")
    assert [r.get("isError", False) for r in results[1:]] == [False, False]
    completed = [p for _, t, p in await events_of(drill.db_url, run_id) if t == "tool.completed"]
    assert [c.get("replayed", False) for c in completed] == [False, True]


async def test_two_claimers_race_for_one_run_and_a_stale_epoch_is_refused(
    drill: ExecStack,
) -> None:
    tenant = await drill.tenant()
    run_id = await tenant.send(prompt("contested"))
    async with internal_channel(drill.addr("orchestrator"), drill.credentials["worker"]) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        claims = await asyncio.gather(
            *(
                stub.ClaimRun(orchestrator_pb2.ClaimRunRequest(worker_id=f"w{i}", wait_ms=0))
                for i in range(8)
            )
        )
        winners = [c for c in claims if c.claimed]
        assert len(winners) == 1 and winners[0].lease.run_id == run_id
        epoch = winners[0].lease.epoch
        with pytest.raises(grpc.aio.AioRpcError) as stale:
            await stub.Checkpoint(
                orchestrator_pb2.CheckpointRequest(run_id=run_id, epoch=epoch - 1)
            )
        assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # Let the lease lapse: the reaper requeues the run and a new claim gets a new epoch.
        await wait_for_status(drill.db_url, run_id, "queued", timeout=10)
        again = await stub.ClaimRun(orchestrator_pb2.ClaimRunRequest(worker_id="w9", wait_ms=2000))
        assert again.claimed and again.lease.epoch == epoch + 1 and again.lease.attempt == 2
        part = common_pb2.Part(
            index=0, role="assistant", final=True, text=common_pb2.TextPart(text="from a zombie")
        )
        with pytest.raises(grpc.aio.AioRpcError) as zombie:
            await stub.Checkpoint(
                orchestrator_pb2.CheckpointRequest(
                    run_id=run_id, epoch=epoch, parts=[orchestrator_pb2.PartWrite(part=part)]
                )
            )
        assert zombie.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert await parts_of(drill.db_url, run_id) == [], "the zombie wrote nothing"


def _batch(run_id: str, epoch: int, number: int, text: str) -> orchestrator_pb2.CheckpointRequest:
    """Checkpoint batch `number`: a final text part 0 announced, and one priced model turn."""
    part = common_pb2.Part(
        index=0, role="assistant", final=True, text=common_pb2.TextPart(text=text)
    )
    added = events_pb2.RunEvent(type="part.added")
    added.part_added.part.CopyFrom(part)
    return orchestrator_pb2.CheckpointRequest(
        run_id=run_id,
        epoch=epoch,
        parts=[orchestrator_pb2.PartWrite(part=part)],
        events=[added],
        turns=[common_pb2.Usage(model="claude-sonnet-5-5", input_tokens=100, output_tokens=7)],
        batch=number,
    )


def _completion(
    lease: orchestrator_pb2.Lease, in_flight: orchestrator_pb2.CheckpointRequest
) -> orchestrator_pb2.CompleteRunRequest:
    return orchestrator_pb2.CompleteRunRequest(
        run_id=lease.run_id,
        epoch=lease.epoch,
        status=common_pb2.RUN_STATUS_COMPLETED,
        result_text="done",
        in_flight=in_flight,
    )


@pytest.mark.parametrize(
    "landed_first", [True, False], ids=["checkpoint-first", "completion-first"]
)
async def test_a_checkpoint_in_flight_at_completion_lands_exactly_once(
    drill: ExecStack, landed_first: bool
) -> None:
    tenant = await drill.tenant()
    run_id = await tenant.send(prompt("in flight"))
    async with internal_channel(drill.addr("orchestrator"), drill.credentials["worker"]) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        claim = await stub.ClaimRun(orchestrator_pb2.ClaimRunRequest(worker_id="w", wait_ms=5000))
        assert claim.claimed and claim.lease.run_id == run_id
        lease = claim.lease
        batch = _batch(run_id, lease.epoch, 1, "the answer so far")

        # A completion whose in-flight batch is not this lease's changes nothing.
        for wrong in (
            _batch(run_id, lease.epoch + 1, 1, "x"),
            _batch(run_id, lease.epoch, 0, "x"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.CompleteRun(_completion(lease, wrong))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (await run_row(drill.db_url, run_id)).status == "running"
        assert await parts_of(drill.db_url, run_id) == []

        if landed_first:
            await stub.Checkpoint(batch)
        done = await stub.CompleteRun(_completion(lease, batch))
        assert done.run.status == common_pb2.RUN_STATUS_COMPLETED

        # The late copy of the batch (the worker's checkpoint answered after the completion,
        # or sent again) is refused and writes nothing.
        before = await events_of(drill.db_url, run_id)
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await stub.Checkpoint(batch)
        assert late.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    events = await events_of(drill.db_url, run_id)
    assert events == before
    types = [t for _, t, _ in events]
    assert types.count("part.added") == 1, "the batch's events were written once"
    assert types.index("part.added") < types.index("run.completed")
    assert [s for s, _, _ in events] == list(range(1, len(events) + 1))
    row = await run_row(drill.db_url, run_id)
    assert (row.usage["input_tokens"], row.usage["output_tokens"]) == (100, 7), "one turn, once"
    assert [p.payload["text"] for p in await parts_of(drill.db_url, run_id)] == [
        "the answer so far"
    ]


async def test_sigterm_releases_the_lease_and_another_worker_finishes(drill: ExecStack) -> None:
    tenant = await drill.tenant()
    text = prompt("graceful")
    words = [f"g{i} " for i in range(400)]
    drill.model.script(
        text, [TextTurn("".join(words), chunks=words, delay_ms=30), TextTurn("Second worker.")]
    )
    first = await drill.start_worker(TETHER_WORKER_GRACE_S="0.5")
    run_id = await tenant.send(text)
    await wait_for_status(drill.db_url, run_id, "running")

    async def streaming() -> bool:
        parts = await parts_of(drill.db_url, run_id)
        return bool(parts and parts[0].payload.get("text"))

    await eventually(streaming, what="streaming to start")
    exit_code = await drill.services.stop(first, grace=15)
    assert exit_code == 0
    row = await run_row(drill.db_url, run_id)
    assert row.status == "queued" and row.attempt == 1, "released, not reaped"
    await drill.start_worker()
    run = await wait_for_status(drill.db_url, run_id, "completed", timeout=20)
    assert run.result_text == "Second worker."
    reasons = [
        p.get("reason") for _, t, p in await events_of(drill.db_url, run_id) if t == "run.queued"
    ]
    assert reasons == ["admitted", "released"]


async def test_a_cancelled_run_whose_worker_died_is_finalised_by_the_orchestrator(
    drill: ExecStack,
) -> None:
    tenant = await drill.tenant()
    text = prompt("cancel an orphan")
    words = [f"o{i} " for i in range(300)]
    drill.model.script(text, [TextTurn("".join(words), chunks=words, delay_ms=30)])
    worker = await drill.start_worker()
    run_id = await tenant.send(text)
    await wait_for_status(drill.db_url, run_id, "running")
    drill.services.kill(worker)
    response = await tenant.cancel(run_id)
    assert response.changed, "the cancel request was recorded on the running run"
    run = await wait_for_status(drill.db_url, run_id, "cancelled", timeout=10)
    assert run.error["code"] == "cancelled"
    assert run.attempt == 1, "not requeued"


async def test_a_killed_and_restarted_orchestrator_loses_no_run(drill: ExecStack) -> None:
    """SIGKILL the orchestrator mid-stream and bring it back once the lease has lapsed: the
    first attempt cannot finish (its next checkpoint finds no orchestrator, and a worker with
    no orchestrator holds no lease), so the new orchestrator's reaper requeues the run and a
    second attempt completes it, keeping what the first persisted."""
    _, run_id, persisted = await streaming_on_first_worker(
        drill, "survive the orchestrator", words=300, delay_ms=30, then="Still here."
    )
    drill.services.kill("orchestrator")
    await eventually(
        lambda: lease_lapsed(drill.db_url, run_id), timeout=20, what="the lease to lapse"
    )
    # Same port, as a Kubernetes Service would give the replacement.
    port = drill.services.procs["orchestrator"].port
    await drill.services.start("orchestrator", extra_env={"TETHER_ORCHESTRATOR_PORT": str(port)})
    run = await wait_for_status(drill.db_url, run_id, "completed", "failed", timeout=60)
    assert (run.status, run.attempt, run.result_text) == ("completed", 2, "Still here.")
    parts = await parts_of(drill.db_url, run_id)
    assert parts[0].payload["text"].startswith(persisted), "the persisted part survived"
    reasons = [
        p.get("reason") for _, t, p in await events_of(drill.db_url, run_id) if t == "run.queued"
    ]
    assert reasons == ["admitted", "lease_expired"]


async def lease_lapsed(db_url: str, run_id: str) -> bool:
    """Whether the run's lease has expired by the database's clock."""
    engine = create_engine(db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            expired = await conn.scalar(
                select(runs.c.lease_expires_at < func.now()).where(runs.c.run_id == run_id)
            )
    finally:
        await engine.dispose()
    return bool(expired)


async def test_redis_pubsub_connections_killed_mid_flight_lose_no_run(
    drill: ExecStack, redis_url: str
) -> None:
    import redis.asyncio as redis

    tenant = await drill.tenant()
    await drill.start_worker()
    texts = [prompt(f"flush {i}") for i in range(5)]
    for text in texts:
        drill.model.script(text, [TextTurn("ok")])
    client = redis.Redis.from_url(redis_url)
    try:
        run_ids = [await tenant.send(texts[0])]
        # Wake-up and cancel listeners lose their connections; claims fall back to polling.
        await client.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
        await client.flushall()
        run_ids += [await tenant.send(text) for text in texts[1:]]
    finally:
        await client.aclose()
    for run_id in run_ids:
        await wait_for_status(drill.db_url, run_id, "completed", timeout=30)


async def test_a_frozen_worker_that_wakes_after_its_lease_was_reaped_writes_nothing(
    drill: ExecStack,
) -> None:
    """The network-cut drill: SIGSTOP a worker mid-stream until its lease is reaped and another
    worker finishes the run, then SIGCONT it: its next checkpoint is fenced out and it stops."""
    first, run_id, _ = await streaming_on_first_worker(
        drill, "freeze me while streaming", words=200, delay_ms=20, then="Second worker's answer."
    )
    frozen = drill.services.procs[first].process
    frozen.send_signal(signal.SIGSTOP)
    try:
        await drill.start_worker()
        run = await wait_for_status(drill.db_url, run_id, "completed", timeout=30)
    finally:
        frozen.send_signal(signal.SIGCONT)
    assert run.attempt == 2 and run.result_text == "Second worker's answer."
    log = drill.services.procs[first].log_path

    async def fenced_out() -> bool | None:
        return True if f"run {run_id}: lease lost" in log.read_text() else None

    await eventually(fenced_out, timeout=20, what="the woken worker to find its lease gone")
    after = await run_row(drill.db_url, run_id)
    assert (after.status, after.last_seq, after.result_text) == (
        "completed",
        run.last_seq,
        "Second worker's answer.",
    ), "the woken worker wrote nothing"
    terminal = [t for _, t, _ in await events_of(drill.db_url, run_id) if t == "run.completed"]
    assert terminal == ["run.completed"]
    assert frozen.poll() is None, "the woken worker is still serving"
