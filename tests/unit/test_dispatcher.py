"""The dispatcher's looks: a claim statement each, so one is made only where it can find
something. The replica's Work (sessions, dispatcher) runs in process against claims this test
holds: it counts the looks, and a run is queued by putting it in line and waking, as admission's
wake-up does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from services.orchestrator.wakeups import Wakeups
from services.orchestrator.work import Work
from tether.v1 import orchestrator_pb2


class Line:
    """Claimable runs in order, leased by `claim_many` (each call one look, recorded)."""

    def __init__(self) -> None:
        self.wakeups = Wakeups()
        self.runs: list[str] = []
        self.looks: list[int] = []

    history_runs = 50

    async def claim_many(self, worker_id: str, n: int, held: Any = None) -> list[Any]:
        self.looks.append(n)
        taken, self.runs[:n] = self.runs[:n], []
        return [SimpleNamespace(run=SimpleNamespace(run_id=r, lease_epoch=1)) for r in taken]

    def queue(self, run_id: str) -> None:
        self.runs.append(run_id)
        self.wakeups.wake([run_id])


async def _complete(request: Any) -> orchestrator_pb2.CompleteRunResponse:
    return orchestrator_pb2.CompleteRunResponse()


async def _release(run_id: str, epoch: int) -> bool:
    return True


async def test_a_slot_given_back_looks_only_once_something_woke_since_the_queue_drained() -> None:
    line = Line()
    work = Work(
        None,  # type: ignore[arg-type]  # no keepalive here: nothing reads the database
        line,  # type: ignore[arg-type]
        lambda one, histories, limit_runs: orchestrator_pb2.ClaimRunResponse(
            claimed=True, lease=orchestrator_pb2.Lease(run_id=one.run.run_id, epoch=1)
        ),
        _release,
        {orchestrator_pb2.CompleteRunRequest: _complete},
        replica_id="test",
        lease_ttl_s=30,
        keepalive_interval_s=10,
        progress_deadline_s=60,
    )
    incoming: asyncio.Queue[orchestrator_pb2.WorkRequest | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[orchestrator_pb2.WorkRequest]:
        while (request := await incoming.get()) is not None:
            yield request

    dispatcher = asyncio.ensure_future(work.dispatch(retry_s=1.0))
    stream = work.serve(requests())
    try:
        hello = orchestrator_pb2.WorkHello(
            protocol_version=1, worker_id="w", outcome_returns_credit=True
        )
        incoming.put_nowait(orchestrator_pb2.WorkRequest(hello=hello))
        assert (await anext(stream)).HasField("welcome")
        incoming.put_nowait(
            orchestrator_pb2.WorkRequest(credits=orchestrator_pb2.WorkCredits(credits=2))
        )
        line.queue("run_1")
        assert (await anext(stream)).lease.lease.run_id == "run_1"
        done = orchestrator_pb2.CompleteRunRequest(run_id="run_1", epoch=1)
        incoming.put_nowait(orchestrator_pb2.WorkRequest(id=1, complete=done))
        assert (await anext(stream)).ack.id == 1  # the slot is back: two credits again
        line.queue("run_2")
        assert (await anext(stream)).lease.lease.run_id == "run_2"
        # One look per run queued: each came back short of the credits (the queue drained),
        # so neither the look after a lease nor the slot given back looked again.
        assert line.looks == [2, 2]
    finally:
        incoming.put_nowait(None)
        await stream.aclose()
        dispatcher.cancel()
