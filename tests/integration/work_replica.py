"""A replica spoken by the test: the orchestrator's side of the Work stream over real gRPC, so
a test chooses the order of what a real worker (its stream, pool and attempts, the SDK against
the local model server) hears."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import grpc

from services.worker.attempt import Attempt
from services.worker.orchestrator_client import Orchestrator
from services.worker.pool import WorkerPool
from services.worker.tools.registry import ToolRegistry
from services.worker.work_stream import WorkStream
from tether.domain import Assignment
from tether.testing.model_server import ModelServer
from tether.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc


class Replica(orchestrator_pb2_grpc.OrchestratorServiceServicer):
    """Welcomes one Work stream (its welcome's fields as given); hands every request to the test,
    a batch's one by one (keepalives apart, with when they came and what they held), and sends
    what the test queues."""

    def __init__(self, **welcome: Any) -> None:
        self.welcome = orchestrator_pb2.WorkWelcome(
            protocol_version=1,
            replica_id="test",
            keepalive_interval_ms=60_000,
            progress_deadline_ms=60_000,
            probes_quiet_workers=True,
        )
        for name, value in welcome.items():
            setattr(self.welcome, name, value)
        self.hello: orchestrator_pb2.WorkHello | None = None
        self.requests: asyncio.Queue[orchestrator_pb2.WorkRequest] = asyncio.Queue()
        self.keepalives: asyncio.Queue[tuple[float, list[str]]] = asyncio.Queue()
        self.outbox: asyncio.Queue[orchestrator_pb2.WorkResponse] = asyncio.Queue()

    async def Work(
        self,
        request_iterator: AsyncIterator[orchestrator_pb2.WorkRequest],
        context: grpc.aio.ServicerContext[
            orchestrator_pb2.WorkRequest, orchestrator_pb2.WorkResponse
        ],
    ) -> AsyncIterator[orchestrator_pb2.WorkResponse]:
        first = await anext(request_iterator)
        assert first.WhichOneof("kind") == "hello"
        self.hello = first.hello
        yield orchestrator_pb2.WorkResponse(welcome=self.welcome)
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
                if one.WhichOneof("kind") == "keepalive":
                    held = [lease.run_id for lease in one.keepalive.held]
                    self.keepalives.put_nowait((time.monotonic(), held))
                else:
                    self.requests.put_nowait(one)

    async def next(self, kind: str | None = None) -> orchestrator_pb2.WorkRequest:
        """The worker's next request (not a keepalive), of `kind` when given."""
        request = await asyncio.wait_for(self.requests.get(), 20)
        if kind is not None:
            assert request.WhichOneof("kind") == kind, f"expected {kind}, got {request}"
        return request

    def ack(self, request: orchestrator_pb2.WorkRequest, *, stale: bool = False) -> None:
        """Answer a completion: OK, or refused as a stale lease."""
        if stale:
            answer = orchestrator_pb2.WorkAck(id=request.id, code=9, error_code="stale_lease")
        else:
            answer = orchestrator_pb2.WorkAck(
                id=request.id, complete=orchestrator_pb2.CompleteRunResponse()
            )
        self.outbox.put_nowait(orchestrator_pb2.WorkResponse(ack=answer))


def lease(run_id: str, prompt: str, epoch: int = 1) -> orchestrator_pb2.WorkResponse:
    """A pushed lease of a one-message run asking `prompt`."""
    return orchestrator_pb2.WorkResponse(
        lease=orchestrator_pb2.ClaimRunResponse(
            claimed=True,
            lease=orchestrator_pb2.Lease(run_id=run_id, epoch=epoch, attempt=1),
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
async def serving(replica: Replica) -> AsyncIterator[grpc.aio.Channel]:
    """The replica on a loopback port; a channel to it."""
    server = grpc.aio.server()
    orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server(replica, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield channel
    finally:
        await channel.close()
        await server.stop(None)


@contextlib.asynccontextmanager
async def worker(
    replica: Replica, model: ModelServer, *, concurrency: int, worker_id: str
) -> AsyncIterator[WorkerPool]:
    """A real worker pool on its Work stream to `replica`, its attempts calling `model`."""
    async with serving(replica) as channel:
        stream = WorkStream(channel, worker_id)
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
