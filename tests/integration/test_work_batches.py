"""The worker's side of batches and of slots given back by outcomes, against a replica spoken by
the test over real gRPC (the worker is real: pool, attempt, stream, the SDK against the local
model server). A replica that says so takes an acknowledged outcome as the slot given back, so
the worker must send no credit for it, and must grant one for any other ending; a batch of
pushed leases runs each."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import anthropic
import grpc
import pytest

from services.worker.assignment import Assignment
from services.worker.attempt import Attempt
from services.worker.orchestrator_client import Orchestrator
from services.worker.pool import WorkerPool
from services.worker.tools.registry import ToolRegistry
from services.worker.work_stream import WorkStream
from tether.testing.model_server import ModelServer, TextTurn
from tether.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="session")


class Replica(orchestrator_pb2_grpc.OrchestratorServiceServicer):
    """Welcomes one Work stream, saying it takes batches and gives slots back on outcomes;
    hands every request (a batch's one by one) to the test and sends what it queues."""

    def __init__(self) -> None:
        self.requests: asyncio.Queue[orchestrator_pb2.WorkRequest] = asyncio.Queue()
        self.outbox: asyncio.Queue[orchestrator_pb2.WorkResponse] = asyncio.Queue()
        self.hello: orchestrator_pb2.WorkHello | None = None

    async def Work(
        self,
        request_iterator: AsyncIterator[orchestrator_pb2.WorkRequest],
        context: grpc.aio.ServicerContext[
            orchestrator_pb2.WorkRequest, orchestrator_pb2.WorkResponse
        ],
    ) -> AsyncIterator[orchestrator_pb2.WorkResponse]:
        self.hello = (await anext(request_iterator)).hello
        yield orchestrator_pb2.WorkResponse(
            welcome=orchestrator_pb2.WorkWelcome(
                protocol_version=1,
                replica_id="test",
                keepalive_interval_ms=60_000,
                progress_deadline_ms=60_000,
                probes_quiet_workers=True,
                takes_batches=True,
                outcome_returns_credit=True,
            )
        )
        reader = asyncio.ensure_future(self._read(request_iterator))
        try:
            while True:
                yield await self.outbox.get()
        finally:
            reader.cancel()

    async def _read(self, requests: AsyncIterator[orchestrator_pb2.WorkRequest]) -> None:
        async for request in requests:
            batch = request.batch.requests if request.HasField("batch") else [request]
            for one in batch:
                if one.WhichOneof("kind") != "keepalive":
                    self.requests.put_nowait(one)

    async def next(self) -> orchestrator_pb2.WorkRequest:
        return await asyncio.wait_for(self.requests.get(), 20)

    def ack(self, request: orchestrator_pb2.WorkRequest, *, stale: bool = False) -> None:
        if stale:
            answer = orchestrator_pb2.WorkAck(id=request.id, code=9, error_code="stale_lease")
        else:
            answer = orchestrator_pb2.WorkAck(
                id=request.id, complete=orchestrator_pb2.CompleteRunResponse()
            )
        self.outbox.put_nowait(orchestrator_pb2.WorkResponse(ack=answer))


def lease(run_id: str, prompt: str) -> orchestrator_pb2.WorkResponse:
    return orchestrator_pb2.WorkResponse(
        lease=orchestrator_pb2.ClaimRunResponse(
            claimed=True,
            lease=orchestrator_pb2.Lease(run_id=run_id, epoch=1, attempt=1),
            run=common_pb2.Run(run_id=run_id, tenant_id="t", root_run_id=run_id, input_text=prompt),
            config=orchestrator_pb2.AgentConfig(
                model="claude-sonnet-5-5",
                limits=orchestrator_pb2.Limits(
                    max_steps=4,
                    max_tool_calls=4,
                    wall_clock_seconds=60,
                    max_input_tokens=100_000,
                    max_output_tokens=4_000,
                    max_cost_micros=10**9,
                    max_attempts=3,
                    max_tokens_per_turn=256,
                ),
            ),
        )
    )


@contextlib.asynccontextmanager
async def worker(
    replica: Replica, model: ModelServer, concurrency: int
) -> AsyncIterator[WorkerPool]:
    server = grpc.aio.server()
    orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server(replica, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stream = WorkStream(channel, "w-batches")
    client = anthropic.AsyncAnthropic(base_url=model.base_url, api_key="test", max_retries=0)

    def make_attempt(assignment: Assignment) -> Attempt:
        return Attempt(
            assignment,
            orchestrator=Orchestrator(stream),
            client=client,
            registry=ToolRegistry([]),
            bus=None,
            checkpoint_interval_s=60.0,
            interactions=None,
        )

    pool = WorkerPool(stream=stream, make_attempt=make_attempt, concurrency=concurrency)
    running = asyncio.ensure_future(pool.run())
    try:
        yield pool
    finally:
        await pool.stop(1.0)
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await running
        await client.close()
        await channel.close()
        await server.stop(None)


async def test_an_acknowledged_outcome_is_not_granted_again_and_a_refused_one_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ANTHROPIC_CUSTOM_HEADERS", raising=False)
    replica = Replica()
    async with ModelServer() as model, worker(replica, model, concurrency=1):
        for prompt in ("one", "two", "three"):
            model.script(prompt, [TextTurn(f"answer {prompt}")])
        assert (await replica.next()).credits.credits == 1
        assert replica.hello is not None and replica.hello.outcome_returns_credit
        replica.outbox.put_nowait(lease("run_one", "one"))
        first = await replica.next()
        assert first.complete.result_text == "answer one"
        replica.ack(first)
        # The acknowledged completion gave the slot back: the next thing the worker sends is
        # the second run's completion, not a credit.
        replica.outbox.put_nowait(lease("run_two", "two"))
        second = await replica.next()
        assert second.WhichOneof("kind") == "complete", f"a credit was sent again: {second}"
        assert second.complete.result_text == "answer two"
        # A refused outcome did not give it back: the worker grants the slot itself.
        replica.ack(second, stale=True)
        granted = await replica.next()
        assert granted.WhichOneof("kind") == "credits" and granted.credits.credits == 1


async def test_a_batch_of_pushed_leases_runs_each(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANTHROPIC_CUSTOM_HEADERS", raising=False)
    replica = Replica()
    async with ModelServer() as model, worker(replica, model, concurrency=2):
        model.script("left", [TextTurn("answer left")])
        model.script("right", [TextTurn("answer right")])
        assert (await replica.next()).credits.credits == 2
        both = [lease("run_left", "left"), lease("run_right", "right")]
        replica.outbox.put_nowait(
            orchestrator_pb2.WorkResponse(batch=orchestrator_pb2.WorkResponses(responses=both))
        )
        completions = [await replica.next() for _ in range(2)]
        for completion in completions:
            replica.ack(completion)
        assert {c.complete.result_text for c in completions} == {"answer left", "answer right"}


async def test_what_is_queued_together_goes_as_one_batch_once_the_replica_takes_them() -> None:
    async with grpc.aio.insecure_channel("127.0.0.1:9") as channel:  # never connected
        await _drain_batches(WorkStream(channel, "w-drain"))


async def _drain_batches(stream: WorkStream) -> None:
    outbox: asyncio.Queue[orchestrator_pb2.WorkRequest] = asyncio.Queue()
    credits = orchestrator_pb2.WorkRequest(credits=orchestrator_pb2.WorkCredits(credits=1))
    keepalive = orchestrator_pb2.WorkRequest(keepalive=orchestrator_pb2.WorkKeepalive())
    drained = stream._drain(outbox)
    outbox.put_nowait(credits)
    outbox.put_nowait(keepalive)
    assert [await anext(drained), await anext(drained)] == [credits, keepalive], "no batch yet"
    stream._batches = True  # the welcome said so
    outbox.put_nowait(credits)
    outbox.put_nowait(keepalive)
    batch = await anext(drained)
    assert list(batch.batch.requests) == [credits, keepalive]
    outbox.put_nowait(credits)
    assert await anext(drained) == credits, "a lone message goes alone"
    await drained.aclose()
