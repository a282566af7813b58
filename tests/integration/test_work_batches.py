"""The worker's side of batches and of slots given back by outcomes, against a replica spoken by
the test over real gRPC (the worker is real: pool, attempt, stream, the SDK against the local
model server). A replica that says so takes an acknowledged outcome as the slot given back, so
the worker must send no credit for it, and must grant one for any other ending; a batch of
pushed leases runs each."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.worker.work_stream import WorkStream
from tests.integration.work_replica import Replica, lease, worker
from tether.testing.model_server import ModelServer, TextTurn
from tether.v1 import orchestrator_pb2

pytestmark = pytest.mark.asyncio(loop_scope="session")

WORKER = "w-batches"


async def test_an_acknowledged_outcome_is_not_granted_again_and_a_refused_one_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ANTHROPIC_CUSTOM_HEADERS", raising=False)
    replica = Replica(takes_batches=True, outcome_returns_credit=True)
    async with ModelServer() as model, worker(replica, model, concurrency=1, worker_id=WORKER):
        for prompt in ("one", "two", "three"):
            model.script(prompt, [TextTurn(f"answer {prompt}")])
        assert (await replica.next("credits")).credits.credits == 1
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
    replica = Replica(takes_batches=True, outcome_returns_credit=True)
    async with ModelServer() as model, worker(replica, model, concurrency=2, worker_id=WORKER):
        model.script("left", [TextTurn("answer left")])
        model.script("right", [TextTurn("answer right")])
        assert (await replica.next("credits")).credits.credits == 2
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
