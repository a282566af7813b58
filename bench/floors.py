"""The floor loops as a load: floor-load processes (bench.floor_load) started, warmed up, then
timed together."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

import asyncpg


@dataclass
class FloorResult:
    """One timed pass of the floor loops: iterations done, wall seconds from the first process's
    start to the last one's end, the CPU seconds the floor processes used themselves, and the
    latency of every iteration."""

    iterations: int
    seconds: float
    cpu_s: float
    latencies_ms: list[float]

    @property
    def per_s(self) -> float:
        return self.iterations / self.seconds


@dataclass
class FloorLoad:
    """Floor-load processes (bench.floor_load), warmed up and waiting for the word."""

    processes: list[asyncio.subprocess.Process]
    iterations: int
    concurrency: int

    async def go(self) -> FloorResult:
        """Start every process at once on one pass of its loops; wait for all to finish
        (another pass may follow)."""
        for process in self.processes:
            assert process.stdin is not None
            process.stdin.write(b"go\n")
            await process.stdin.drain()
        spans = []
        for process in self.processes:
            assert process.stdout is not None
            spans.append(json.loads(await asyncio.wait_for(process.stdout.readline(), 120)))
        done = len(self.processes) * (self.iterations // self.concurrency * self.concurrency)
        return FloorResult(
            iterations=done,
            seconds=max(s["end"] for s in spans) - min(s["start"] for s in spans),
            cpu_s=sum(s["cpu_s"] for s in spans),
            latencies_ms=[ms for s in spans for ms in s["latencies_ms"]],
        )


@contextlib.asynccontextmanager
async def floor_load(
    model_url: str, gateway: str, db_url: str, *, processes: int, iterations: int, concurrency: int
) -> AsyncIterator[FloorLoad]:
    """`processes` floor-load processes of `concurrency` loops each, `iterations` per process,
    ready to go; killed on exit."""
    db = await asyncpg.connect(db_url)
    try:
        await db.execute(
            "CREATE TABLE IF NOT EXISTS floor_probe "
            "(id bigserial PRIMARY KEY, at timestamptz NOT NULL DEFAULT now())"
        )
    finally:
        await db.close()
    started = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.floor_load",
            model_url,
            gateway,
            db_url,
            str(iterations),
            str(concurrency),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        for _ in range(processes)
    ]
    try:
        for process in started:
            assert process.stdout is not None
            ready = await asyncio.wait_for(process.stdout.readline(), 60)
            if ready.strip() != b"ready":
                raise RuntimeError(f"floor load did not start: {ready!r}")
        yield FloorLoad(started, iterations, concurrency)
    finally:
        for process in started:
            if process.returncode is None:
                process.kill()
            await process.wait()


FLOOR_EACH_RUN = (
    "1 no-op unary RPC to the gateway (grpc.health.v1.Health/Check) + "
    "3 single-row durable commits (autocommit inserts: admission, lease, completion) + "
    "1 bare streamed SDK call to the local model, fully consumed"
)
