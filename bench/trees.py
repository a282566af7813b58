"""`make bench BENCH=trees`: what a delegation costs and how late timers fire (issue 33).

`delegate_overhead_ratio` (goal <= 1.5): a parent that delegates to one child, end to end (from
the SendMessage that admits it to its completion), over what the same work costs without the
tree: a parent making the same two model turns with a local tool (`get_time`) in place of the
delegation, plus the child's own run as a run of its own. One stack, one worker, the local
model server; the three kinds of run alternate, so each sees the same machine; medians.

`timer_fire_lateness_ms_p99` (goal <= 1,000): 1,000 runs parked on timers due in the same
second, each through the Work stream as a worker parks it (the bench is the worker, so the
runs wait for nothing but their timers), and the lateness of each from its due time to its
`timer.fired` committed (the event's time, the database's clock).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from bench.common import BenchStack, bench_stack, emit, percentile
from bench.model import Model, model_server
from bench.runs import SERVICES, Completions, completions, worker_env
from services.worker.work_stream import Held, WorkStream
from tether import apikeys
from tether.client import TetherClient
from tether.convert import status_to_proto, timestamp
from tether.db.engine import create_engine
from tether.db.schema import run_event_log, runs
from tether.domain import Assignment, RenderJob
from tether.runtime.rpc import internal_channel
from tether.states import RunStatus
from tether.v1 import orchestrator_pb2

PAIRS = 30  # each kind of run, after the warm-up (10 left the ratio spread 1.77 to 2.09)
WARM_UP = 2
TIMERS = 1_000
DUE_IN_S = 8.0  # from the first park: long enough for every park to land before
SCOPES = (*apikeys.CLIENT_SCOPES, apikeys.AGENTS_READ, apikeys.AGENTS_WRITE)
CATALOG_WAIT_S = 30.0


async def _tenant(stack: BenchStack) -> str:
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.begin() as conn:
            tenant_id = f"trees-{uuid.uuid4().hex[:6]}"
            await apikeys.ensure_tenant(conn, tenant_id)
            key, _ = await apikeys.create_key(conn, tenant_id, "bench", SCOPES)
    finally:
        await engine.dispose()
    return key


async def _timed(client: TetherClient, done: Completions, text: str, channel: str = "") -> float:
    """Milliseconds from sending `text` to its run's terminal event (as a client watching it
    sees it: no polling between)."""
    start = time.perf_counter()
    sent = await client.send(
        text, conversation_id=f"b-{uuid.uuid4().hex}", event_id=uuid.uuid4().hex, channel=channel
    )
    ended, outcome = await done.wait(sent.run.run_id)
    if outcome != "completed":
        raise RuntimeError(f"bench run {sent.run.run_id} ended {outcome}")
    return (ended - start) * 1000


def _turn(text: str) -> dict[str, object]:
    return {"kind": "text", "text": text}


async def delegate_overhead(stack: BenchStack, model: Model) -> None:
    key = await _tenant(stack)
    gateway = stack.services.addresses()["gateway"]
    samples: dict[str, list[float]] = {"delegating": [], "local_tool": [], "child_alone": []}
    async with TetherClient(gateway, key) as client, completions(stack.redis_url) as done:
        # An agent may name only a tool a worker announced: wait for the worker's hello.
        deadline = time.perf_counter() + CATALOG_WAIT_S
        while "get_time" not in {t.name for t in (await client.list_tools()).tools}:
            if time.perf_counter() > deadline:
                raise RuntimeError("no worker announced get_time")
            await asyncio.sleep(0.1)
        await client.apply_agent(json.dumps({"name": "lead", "tools": ["get_time"]}))
        await client.apply_agent(
            json.dumps({"name": "researcher", "routes": [{"channel": "research"}]})
        )
        await client.apply_agent(
            json.dumps(
                {"name": "lead", "tools": ["get_time"], "delegation": {"agents": ["researcher"]}}
            )
        )
        for i in range(PAIRS + WARM_UP):
            tag = uuid.uuid4().hex
            parent, child = f"delegate {tag}", f"child task {tag}"
            call = {"agent": "researcher", "message": child}
            await model.script(
                parent,
                [{"kind": "tool_use", "name": "delegate", "input": call}, _turn("done")],
            )
            await model.script(child, [_turn("the child's answer")])
            local = f"local tool {tag}"
            await model.script(
                local, [{"kind": "tool_use", "name": "get_time", "input": {}}, _turn("done")]
            )
            alone = f"child alone {tag}"
            await model.script(alone, [_turn("the child's answer")])
            timed = {
                "delegating": await _timed(client, done, parent),
                "local_tool": await _timed(client, done, local),
                "child_alone": await _timed(client, done, alone, channel="research"),
            }
            if i >= WARM_UP:
                for kind, ms in timed.items():
                    samples[kind].append(ms)
    p50 = {kind: statistics.median(values) for kind, values in samples.items()}
    config = {"pairs": PAIRS, "workers": 1, **{f"{k}_ms_p50": round(v, 1) for k, v in p50.items()}}
    ratio = p50["delegating"] / (p50["local_tool"] + p50["child_alone"])
    emit("delegate_overhead_ratio", ratio, "ratio", goal=1.5, **config)


class _Parker:
    """The bench's side of the Work stream: each pushed lease is parked on the shared due time."""

    def __init__(self, stream: WorkStream, due: datetime) -> None:
        self._stream = stream
        self._due = due
        self.parked: set[str] = set()
        self.writes: list[asyncio.Task[object]] = []
        self.all_parked = asyncio.Event()

    def leased(self, assignment: Assignment) -> None:
        lease = assignment.lease
        if lease.run_id in self.parked:
            return  # woken and leased again: the bench has measured it
        self.parked.add(lease.run_id)
        request = orchestrator_pb2.ParkRunRequest(
            run_id=lease.run_id,
            epoch=lease.epoch,
            status=status_to_proto(RunStatus.WAITING_FOR_TIMER),
            wake_at=timestamp(self._due),
            tool_call_id="toolu_bench",
        )
        self.writes.append(asyncio.ensure_future(self._stream.write(request)))
        if len(self.parked) >= TIMERS:
            self.all_parked.set()

    def cancelled(self, run_id: str, epoch: int) -> None:
        pass

    def lost(self, run_id: str, epoch: int) -> None:
        pass

    def held(self) -> Sequence[Held]:
        return []

    def render(self, job: RenderJob) -> None:
        pass  # no agent is rendered here


async def timer_lateness(stack: BenchStack) -> None:
    key = await _tenant(stack)
    gateway = stack.services.addresses()["gateway"]
    channel = internal_channel(
        stack.services.addresses()["orchestrator"], stack.credentials["worker"]
    )
    due = (datetime.now(UTC) + timedelta(seconds=DUE_IN_S + TIMERS / 100)).replace(microsecond=0)
    stream = WorkStream(channel, f"bench-{uuid.uuid4().hex[:6]}")
    parker = _Parker(stream, due)
    serving = asyncio.ensure_future(stream.run(parker))
    engine = create_engine(stack.db_url, pool_size=2)
    try:
        await asyncio.wait_for(stream.connected.wait(), 30)
        stream.grant(TIMERS)
        async with TetherClient(gateway, key) as client:
            sends = asyncio.Semaphore(16)

            async def send(i: int) -> str:
                async with sends:
                    sent = await client.send(
                        f"timer {i}",
                        conversation_id=f"t-{i}-{uuid.uuid4().hex[:6]}",
                        event_id=uuid.uuid4().hex,
                    )
                    return str(sent.run.run_id)

            run_ids = await asyncio.gather(*(send(i) for i in range(TIMERS)))
        await asyncio.wait_for(parker.all_parked.wait(), 120)
        await asyncio.gather(*parker.writes)
        if datetime.now(UTC) >= due:
            raise RuntimeError("the parks outlasted the due time: raise DUE_IN_S")
        lateness = await _fired(engine, run_ids, due)
    finally:
        await engine.dispose()
        await stream.close()
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        await channel.close()
    emit(
        "timer_fire_lateness_ms_p99",
        percentile(lateness, 99),
        "ms",
        goal=1000,
        timers=TIMERS,
        p50_ms=round(percentile(lateness, 50), 1),
        max_ms=round(max(lateness), 1),
    )


async def _fired(engine: AsyncEngine, run_ids: list[str], due: datetime) -> list[float]:
    """Each run's lateness (ms) from `due` to its timer.fired, once every one has fired."""
    deadline = time.perf_counter() + (due - datetime.now(UTC)).total_seconds() + 60
    stmt = (
        select(run_event_log.c.run_id, run_event_log.c.created_at)
        .join(runs, runs.c.run_id == run_event_log.c.run_id)
        .where(run_event_log.c.run_id.in_(run_ids), run_event_log.c.type == "timer.fired")
    )
    count = select(func.count()).select_from(stmt.subquery())
    async with engine.connect() as conn:
        while (await conn.scalar(count) or 0) < len(run_ids):
            if time.perf_counter() > deadline:
                raise TimeoutError("not every timer fired within a minute of its due time")
            await asyncio.sleep(0.2)
        rows = (await conn.execute(stmt)).all()
    return [(r.created_at - due).total_seconds() * 1000 for r in rows]


async def run() -> None:
    """Run the trees group."""
    async with model_server() as model, bench_stack(SERVICES) as stack:
        worker = await stack.services.start("worker", extra_env=worker_env(model))
        await delegate_overhead(stack, model)
        await stack.services.stop(worker.name)
        await timer_lateness(stack)
