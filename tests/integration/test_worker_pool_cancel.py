"""A cancel pushed to a worker whose attempt has already sent its completion does not replace
that completion with a second, empty ending: the completion lands, and the orchestrator (which
took the cancel first) ends the run cancelled with the completion's parts kept. Before, the pool
cancelled the attempt's task under its unanswered completion and reported a cancelled ending
without them, and whichever of the two the orchestrator wrote first won: the answer was lost.

The worker is real (pool, attempt, stream, the SDK against the local model server); the replica
is this test, speaking the Work protocol over real gRPC, so the order of what the worker hears
is the test's to choose."""

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

PROMPT = "answer, then be cancelled"
RUN_ID, EPOCH = "run_pushed_cancel", 1


class Replica(orchestrator_pb2_grpc.OrchestratorServiceServicer):
    """Welcomes one Work stream; hands every request to the test; sends what it queues."""

    def __init__(self) -> None:
        self.requests: asyncio.Queue[orchestrator_pb2.WorkRequest] = asyncio.Queue()
        self.outbox: asyncio.Queue[orchestrator_pb2.WorkResponse] = asyncio.Queue()

    async def Work(
        self,
        request_iterator: AsyncIterator[orchestrator_pb2.WorkRequest],
        context: grpc.aio.ServicerContext[
            orchestrator_pb2.WorkRequest, orchestrator_pb2.WorkResponse
        ],
    ) -> AsyncIterator[orchestrator_pb2.WorkResponse]:
        await anext(request_iterator)  # the hello
        yield orchestrator_pb2.WorkResponse(
            welcome=orchestrator_pb2.WorkWelcome(
                protocol_version=1,
                replica_id="test",
                keepalive_interval_ms=60_000,
                progress_deadline_ms=60_000,
                probes_quiet_workers=True,
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
            if request.WhichOneof("kind") != "keepalive":
                self.requests.put_nowait(request)

    async def next(self, kind: str) -> orchestrator_pb2.WorkRequest:
        request = await asyncio.wait_for(self.requests.get(), 20)
        assert request.WhichOneof("kind") == kind, f"expected {kind}, got {request}"
        return request


def _lease() -> orchestrator_pb2.ClaimRunResponse:
    return orchestrator_pb2.ClaimRunResponse(
        claimed=True,
        lease=orchestrator_pb2.Lease(run_id=RUN_ID, epoch=EPOCH, attempt=1),
        run=common_pb2.Run(run_id=RUN_ID, tenant_id="t", root_run_id=RUN_ID, input_text=PROMPT),
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


@contextlib.asynccontextmanager
async def worker(replica: Replica, model: ModelServer) -> AsyncIterator[WorkerPool]:
    server = grpc.aio.server()
    orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server(replica, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stream = WorkStream(channel, "w-pushed-cancel")
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

    pool = WorkerPool(stream=stream, make_attempt=make_attempt, concurrency=1)
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


async def test_a_cancel_pushed_after_the_completion_was_sent_leaves_the_completion_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ANTHROPIC_CUSTOM_HEADERS", raising=False)
    replica = Replica()
    async with ModelServer() as model, worker(replica, model):
        model.script(PROMPT, [TextTurn("Here it is.")])
        assert (await replica.next("credits")).credits.credits == 1
        replica.outbox.put_nowait(orchestrator_pb2.WorkResponse(lease=_lease()))
        sent = await replica.next("complete")
        assert sent.complete.status == common_pb2.RUN_STATUS_COMPLETED
        assert sent.complete.result_text == "Here it is."

        # The caller's cancel reaches the worker before the completion's answer does.
        cancel = orchestrator_pb2.WorkCancel(run_id=RUN_ID, epoch=EPOCH)
        replica.outbox.put_nowait(orchestrator_pb2.WorkResponse(cancel=cancel))
        answered = orchestrator_pb2.WorkAck(
            id=sent.id, complete=orchestrator_pb2.CompleteRunResponse()
        )
        replica.outbox.put_nowait(orchestrator_pb2.WorkResponse(ack=answered))

        # The slot comes back once the attempt is over: anything it sent meanwhile came first.
        after = await asyncio.wait_for(replica.requests.get(), 20)
        assert after.WhichOneof("kind") == "credits", f"a second ending was sent: {after}"
