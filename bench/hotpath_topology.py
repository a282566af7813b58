"""The topology floor as a load (bench.topology_floor): its processes started on a fresh
database, warmed up, then a saturated batch timed with the CPU of every process, measured the
way the stack's saturated runs are."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import asyncpg
import grpc
import redis.asyncio as redis

from bench import topology_floor as floor
from bench.common import Servers, bench_database
from bench.cpu import CpuMeter, Sample
from bench.hotpath_stage import postmaster_pid, redis_pid
from bench.model import Model
from bench.runs import SUBMITTERS, WORKER_CONCURRENCY, WORKERS

WARMUP_RUNS = 200


@dataclass
class TopologyResult:
    """A batch through the topology floor: runs, seconds, the CPU they took and each run's ms
    from its call to the edge to its ending heard on Redis."""

    runs: int
    seconds: float
    used: Sample
    latencies_ms: list[float]

    @property
    def per_s(self) -> float:
        return self.runs / self.seconds


@dataclass
class Topology:
    """The topology floor's processes, ready for load."""

    edge: str
    db_url: str
    redis_url: str
    meter: CpuMeter
    completed: int = 0  # runs the floor completed so far (warm-up included)
    records: bool = False  # the intake's and the dispatcher's statements are Tether's own

    async def saturate(self, runs: int, callers: int = SUBMITTERS) -> TopologyResult:
        """`runs` runs from `callers` callers, each waiting for its run's ending before it
        sends the next when there is one caller (light load), not waiting when there are more
        (saturation: done when the last ending is heard)."""
        bus = redis.Redis.from_url(self.redis_url)
        pubsub = bus.pubsub()
        await pubsub.subscribe(floor.DONE)
        while (await pubsub.get_message(timeout=5.0)) is None:
            pass  # the subscription's confirmation: no ending can be missed
        loop = asyncio.get_running_loop()
        endings: dict[bytes, asyncio.Future[float]] = {}
        all_ended: asyncio.Future[None] = loop.create_future()

        def ending(run_id: bytes) -> asyncio.Future[float]:
            return endings.setdefault(run_id, loop.create_future())

        async def listen() -> None:
            async for message in pubsub.listen():
                if message["type"] == "message":
                    ending(message["data"]).set_result(time.perf_counter())
                    if len(endings) == runs and all(f.done() for f in endings.values()):
                        all_ended.set_result(None)

        remaining = iter(range(runs))
        latencies_ms: list[float] = []
        async with grpc.aio.insecure_channel(self.edge) as channel:
            send = channel.unary_unary(floor.SEND)

            async def submitter() -> None:
                for _ in remaining:
                    began = time.perf_counter()
                    run_id = await send(b"bench")
                    if callers == 1:
                        latencies_ms.append((await ending(run_id) - began) * 1000)

            listener = asyncio.ensure_future(listen())
            before, start = self.meter.sample(), time.perf_counter()
            try:
                await asyncio.gather(*(submitter() for _ in range(callers)))
                await asyncio.wait_for(all_ended, 120)
                seconds, used = time.perf_counter() - start, self.meter.sample() - before
            finally:
                listener.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await listener
                await pubsub.aclose()
                await bus.aclose()
        # The floor does its work, not only its messages: every run it heard of is stored
        # completed.
        self.completed += runs
        db = await asyncpg.connect(self.db_url)
        try:
            table = "runs" if self.records else floor.TABLE
            stored = await db.fetchval(f"SELECT count(*) FROM {table} WHERE status = 'completed'")
        finally:
            await db.close()
        if stored != self.completed:
            raise RuntimeError(f"the topology floor stored {stored} of {self.completed} runs")
        return TopologyResult(runs, seconds, used, latencies_ms)


@contextlib.asynccontextmanager
async def topology(
    servers: Servers, model: Model, *, runners: int = WORKERS, records: bool = False
) -> AsyncIterator[Topology]:
    """The floor's processes (`runners` runners of WORKER_CONCURRENCY) on a fresh database,
    warmed up (when a runner takes what is admitted); stopped on exit. With `records`, the
    intake and the dispatcher send Tether's own statements (admission's, the claim, the
    completion) instead of their one-row writes."""
    processes: dict[str, list[asyncio.subprocess.Process]] = {}

    async def start(role: str, *args: str) -> str:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.topology_floor",
            role,
            *args,
            stdout=asyncio.subprocess.PIPE,
        )
        processes.setdefault(role, []).append(process)
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
        if not line.startswith(("listening ", "ready")):
            raise RuntimeError(f"topology floor {role} did not start: {line!r}")
        return f"127.0.0.1:{line.split()[1]}" if line.startswith("listening") else ""

    async with bench_database(servers.server_url) as (db_url, _):
        await floor.prepare(db_url)
        try:
            kept = ["records"] if records else []
            intake = await start("intake", db_url, servers.redis_url, *kept)
            dispatcher = await start("dispatcher", db_url, servers.redis_url, *kept)
            edge = await start("edge", intake)
            for _ in range(runners):
                await start("runner", dispatcher, model.base_url, str(WORKER_CONCURRENCY))
            roles = {"edge": "gateway", "intake": "admission", "dispatcher": "orchestrator"}
            redis_process, postmaster = await redis_pid(servers.redis_url), postmaster_pid(servers)

            def pids() -> dict[str, list[int]]:
                found = {roles.get(r, "worker"): [p.pid for p in ps] for r, ps in processes.items()}
                return {
                    **found,
                    "postgres": [postmaster],
                    "redis": [redis_process],
                    "model_server": [model.pid],
                    "bench": [os.getpid()],
                }

            meter = CpuMeter(pids, frozenset({"postgres"}))
            current = Topology(edge, db_url, servers.redis_url, meter, records=records)
            if runners:
                await current.saturate(WARMUP_RUNS)
            yield current
        finally:
            for group in processes.values():
                for process in group:
                    if process.returncode is None:
                        process.terminate()
                    await process.wait()
