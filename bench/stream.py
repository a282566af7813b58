"""Stream figures: how long a committed event takes to reach StreamRun subscribers (p50/p99
with 1, 100 and 1000 subscribers on one run), and how fast a reconnect at seq 0 replays a
10,000-event run through the Python client (which asks for the catch-up in batches; the
one-event-per-message rate is reported beside it).

No worker runs: the bench claims each run itself and drives Checkpoint RPCs, each appending one
event. Latency is the subscriber's receipt time minus the event's `created_at` as published,
which the orchestrator stamps right after the commit, so it covers the Redis hop, the
gateway's fan-out and gRPC delivery. The next event is checkpointed once every subscriber has
the previous one, so the figure is latency, not queueing. Everything (PostgreSQL, Redis, the
services and the subscribers) shares this machine's cores.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
import uuid
from dataclasses import dataclass, field

import grpc

from bench.common import BenchStack, bench_stack, emit, percentile
from tether.client import TetherClient
from tether.runtime.rpc import internal_channel
from tether.v1 import (
    events_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
)

SERVICES = ("orchestrator", "admission", "interactions", "gateway")
SUBSCRIBERS = (1, 100, 1000)
EVENTS = {1: 300, 100: 200, 1000: 100}  # per configuration: enough samples for a stable p99
WARMUP_EVENTS = 10
CHANNELS = 16  # client connections the subscribers share (one HTTP/2 connection each)
REPLAY_EVENTS = 10_000
REPLAY_BATCH = 500  # events per Checkpoint while filling the replayed run
REPLAY_ROUNDS = 3
TIMEOUT_S = 60.0


@dataclass
class Subscribers:
    """N StreamRun calls on one run, recording when each durable event arrived."""

    count: int
    received: dict[int, int] = field(default_factory=dict)  # seq -> subscribers that have it
    latencies_ms: list[float] = field(default_factory=list)
    ready: int = 0
    arrived: dict[int, asyncio.Event] = field(default_factory=dict)

    def waiter(self, seq: int) -> asyncio.Event:
        return self.arrived.setdefault(seq, asyncio.Event())

    def record(self, event: events_pb2.RunEvent, measuring: bool) -> None:
        if measuring:
            sent = event.created_at.seconds + event.created_at.nanos / 1e9
            self.latencies_ms.append((time.time() - sent) * 1000)
        count = self.received.get(event.seq, 0) + 1
        self.received[event.seq] = count
        if count == self.count:
            self.waiter(event.seq).set()


async def _subscribe(
    stubs: list[gateway_pb2_grpc.GatewayServiceStub],
    metadata: tuple[tuple[str, str], ...],
    run_id: str,
    subscribers: Subscribers,
    measuring: list[bool],
) -> list[asyncio.Task[None]]:
    async def one(stub: gateway_pb2_grpc.GatewayServiceStub) -> None:
        call = stub.StreamRun(gateway_pb2.StreamRunRequest(run_id=run_id), metadata=metadata)
        async for response in call:
            if response.HasField("snapshot"):
                subscribers.ready += 1
            elif response.event.seq:
                subscribers.record(response.event, measuring[0])

    return [asyncio.ensure_future(one(stubs[i % len(stubs)])) for i in range(subscribers.count)]


async def _claimed_run(
    stack: BenchStack,
    gateway: gateway_pb2_grpc.GatewayServiceStub,
    orchestrator: orchestrator_pb2_grpc.OrchestratorServiceStub,
) -> tuple[str, int, int]:
    """A new run, leased to the bench: (run_id, epoch, last_seq)."""
    sent = await gateway.SendMessage(
        gateway_pb2.SendMessageRequest(
            event_id=uuid.uuid4().hex, conversation_id=f"bench-{uuid.uuid4().hex}", text="bench"
        ),
        metadata=(("authorization", f"Bearer {stack.api_key}"),),
    )
    claim = await orchestrator.ClaimRun(
        orchestrator_pb2.ClaimRunRequest(worker_id="bench", wait_ms=5000)
    )
    assert claim.claimed and claim.lease.run_id == sent.run.run_id, "another run was claimed"
    return claim.lease.run_id, claim.lease.epoch, claim.last_seq


def _checkpoint(run_id: str, epoch: int, count: int) -> orchestrator_pb2.CheckpointRequest:
    events = [
        events_pb2.RunEvent(
            type="run.checkpointed", run_checkpointed=events_pb2.RunCheckpointed(part_count=i)
        )
        for i in range(count)
    ]
    return orchestrator_pb2.CheckpointRequest(run_id=run_id, epoch=epoch, events=events)


async def _latency(
    stack: BenchStack,
    gateway: gateway_pb2_grpc.GatewayServiceStub,
    orchestrator: orchestrator_pb2_grpc.OrchestratorServiceStub,
    subscriber_count: int,
) -> None:
    run_id, epoch, last_seq = await _claimed_run(stack, gateway, orchestrator)
    channels = [
        grpc.aio.insecure_channel(stack.services.addresses()["gateway"])
        for _ in range(min(CHANNELS, subscriber_count))
    ]
    stubs = [gateway_pb2_grpc.GatewayServiceStub(c) for c in channels]
    subscribers = Subscribers(subscriber_count)
    measuring = [False]
    tasks = await _subscribe(
        stubs, (("authorization", f"Bearer {stack.api_key}"),), run_id, subscribers, measuring
    )
    rpc_ms: list[float] = []
    try:
        async with asyncio.timeout(TIMEOUT_S):
            await subscribers.waiter(last_seq).wait()  # everyone is on the live tail
            for i in range(WARMUP_EVENTS + EVENTS[subscriber_count]):
                measuring[0] = i >= WARMUP_EVENTS
                started = time.perf_counter()
                response = await orchestrator.Checkpoint(_checkpoint(run_id, epoch, 1))
                rpc_ms.append((time.perf_counter() - started) * 1000)
                await subscribers.waiter(response.last_seq).wait()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for channel in channels:
            await channel.close()
    samples = subscribers.latencies_ms
    config = {
        "subscribers": subscriber_count,
        "events": EVENTS[subscriber_count],
        "samples": len(samples),
        "checkpoint_rpc_p50_ms": round(statistics.median(rpc_ms), 3),
        "cpus": os.cpu_count(),
    }
    emit(f"stream_p50_ms_s{subscriber_count}", statistics.median(samples), "ms", **config)
    emit(f"stream_p99_ms_s{subscriber_count}", percentile(samples, 99), "ms", **config)


async def _replay(
    stack: BenchStack,
    gateway: gateway_pb2_grpc.GatewayServiceStub,
    orchestrator: orchestrator_pb2_grpc.OrchestratorServiceStub,
) -> None:
    run_id, epoch, _ = await _claimed_run(stack, gateway, orchestrator)
    last_seq = 0
    for _ in range(REPLAY_EVENTS // REPLAY_BATCH):
        response = await orchestrator.Checkpoint(_checkpoint(run_id, epoch, REPLAY_BATCH))
        last_seq = response.last_seq
    rates = [await _replay_once(stack, run_id, last_seq) for _ in range(REPLAY_ROUNDS)]
    unbatched = [
        await _replay_once(stack, run_id, last_seq, batched=False) for _ in range(REPLAY_ROUNDS)
    ]
    emit(
        "replay_events_per_s",
        statistics.median(rates),
        "events/s",
        events=last_seq,
        rounds=REPLAY_ROUNDS,
        rates=[round(r) for r in rates],
        client="tether.client watch (batched catch-up)",
        unbatched_events_per_s=round(statistics.median(unbatched)),
        cpus=os.cpu_count(),
    )


async def _replay_once(
    stack: BenchStack, run_id: str, last_seq: int, batched: bool = True
) -> float:
    """Events/s of one reconnect at seq 0, until the run's last event arrived."""
    gateway = stack.services.addresses()["gateway"]
    received = 0
    async with TetherClient(gateway, stack.api_key) as client:
        started = time.perf_counter()
        if batched:
            async for item in client.watch(run_id):
                if item.HasField("event") and item.event.seq:
                    received += 1
                    if item.event.seq == last_seq:
                        break
        else:
            call = client.stub.StreamRun(
                gateway_pb2.StreamRunRequest(run_id=run_id),
                metadata=(("authorization", f"Bearer {stack.api_key}"),),
            )
            async for response in call:
                if response.HasField("event") and response.event.seq:
                    received += 1
                    if response.event.seq == last_seq:
                        break
            call.cancel()
        return received / (time.perf_counter() - started)


async def _measure(stack: BenchStack) -> None:
    addresses = stack.services.addresses()
    async with (
        grpc.aio.insecure_channel(addresses["gateway"]) as gateway_channel,
        internal_channel(
            addresses["orchestrator"], stack.credentials["worker"]
        ) as orchestrator_channel,
    ):
        gateway = gateway_pb2_grpc.GatewayServiceStub(gateway_channel)
        orchestrator = orchestrator_pb2_grpc.OrchestratorServiceStub(orchestrator_channel)
        for count in SUBSCRIBERS:
            await _latency(stack, gateway, orchestrator, count)
        await _replay(stack, gateway, orchestrator)


async def run() -> None:
    """Run the stream group."""
    extra_env = {
        # The bench holds its leases without heartbeats; none may lapse mid-measurement.
        "TETHER_ORCHESTRATOR_LEASE_TTL_S": "600",
        "TETHER_ORCHESTRATOR_POOL_SIZE": "20",
    }
    async with bench_stack(SERVICES, extra_env=extra_env) as stack:
        await _measure(stack)
