"""The worker's side of the Work stream's keepalives, against a replica this test speaks for over
real gRPC: a worker holding leases renews them every keepalive interval; one holding none sends
nothing to a replica that probes quiet workers, answers a probe at once, and keeps sending to a
replica of the release before probes (which would otherwise take it for frozen)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
import pytest

from services.worker.work_stream import Held, WorkStream
from tests.integration.work_replica import Replica, serving
from tether.domain import Assignment
from tether.v1 import orchestrator_pb2

pytestmark = pytest.mark.asyncio(loop_scope="session")

KEEPALIVE_S = 0.1


@dataclass
class Pool:
    """The pool's side as the stream sees it: only the leases it holds matter here."""

    holding: list[Held] = field(default_factory=list)

    def leased(self, assignment: Assignment) -> None:
        raise AssertionError("no lease is pushed in these tests")

    def cancelled(self, run_id: str, epoch: int) -> None:
        raise AssertionError("no cancel is pushed in these tests")

    def lost(self, run_id: str, epoch: int) -> None:
        raise AssertionError("no lease is lost in these tests")

    def held(self) -> Sequence[Held]:
        return list(self.holding)


@contextlib.asynccontextmanager
async def streaming(replica: Replica, pool: Pool) -> AsyncIterator[WorkStream]:
    async with serving(replica) as channel:
        stream = WorkStream(channel, "w-keepalives")
        running = asyncio.ensure_future(stream.run(pool))
        try:
            await asyncio.wait_for(stream.connected.wait(), 10)
            yield stream
        finally:
            await stream.close()
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await running


def make_replica(*, probes: bool) -> Replica:
    return Replica(keepalive_interval_ms=int(KEEPALIVE_S * 1000), probes_quiet_workers=probes)


async def test_a_worker_holding_no_lease_is_silent_until_probed_and_renews_what_it_holds() -> None:
    replica, pool = make_replica(probes=True), Pool()
    async with streaming(replica, pool):
        # Ten keepalive intervals with nothing held: nothing is sent (time is the rule here).
        await asyncio.sleep(10 * KEEPALIVE_S)
        assert replica.keepalives.empty(), "an idle worker sends no keepalives"

        asked = time.monotonic()
        replica.outbox.put_nowait(orchestrator_pb2.WorkResponse(probe=orchestrator_pb2.WorkProbe()))
        answered, held = await asyncio.wait_for(replica.keepalives.get(), 10)
        assert held == [] and answered - asked < KEEPALIVE_S, "a probe is answered at once"

        pool.holding.append(Held("run_1", 1, 0.0))
        beats = [await asyncio.wait_for(replica.keepalives.get(), 10) for _ in range(3)]
        assert all(held == ["run_1"] for _, held in beats), "a held lease is renewed"
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(beats)]
        assert all(gap < 3 * KEEPALIVE_S for gap in gaps), gaps


async def test_a_worker_keeps_sending_keepalives_to_a_replica_that_does_not_probe() -> None:
    replica, pool = make_replica(probes=False), Pool()
    async with streaming(replica, pool):
        beats = [await asyncio.wait_for(replica.keepalives.get(), 10) for _ in range(3)]
        assert all(held == [] for _, held in beats), "idle, but the replica would think it frozen"
