"""One process of the run floor: loops that each do, per iteration, the least a durable run
costs in any design: one unary RPC to the edge (the gateway's health check, through its real
server and interceptors), three durable commits (the smallest there is: one single-row insert
each, in autocommit, as admission, the claim's lease and the completion each need at least)
and one streamed SDK call to the model, fully consumed.

`python -m bench.floor_load MODEL_URL GATEWAY_ADDR DB_URL ITERATIONS CONCURRENCY` warms up,
prints `ready`, then for each line on stdin runs ITERATIONS and prints `{"start": ..., "end":
..., "cpu_s": ..., "latencies_ms": [...]}` (start and end on the monotonic clock, comparable
across processes; cpu_s its own CPU over the timed loops), so several processes can be timed
as one load, again and again; it ends when stdin does.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import asyncpg
import grpc
from anthropic import AsyncAnthropic
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.cpu import cpu_s
from bench.model import BENCH_REQUEST, streamed_call
from tether.runtime.process import run

COMMITS = 3
INSERT = "INSERT INTO floor_probe DEFAULT VALUES"


async def _load(
    model_url: str, gateway: str, db_url: str, iterations: int, concurrency: int
) -> None:
    sdk = AsyncAnthropic(base_url=model_url, api_key="bench", max_retries=0)
    channel = grpc.aio.insecure_channel(gateway)
    health = health_pb2_grpc.HealthStub(channel)
    pool = await asyncpg.create_pool(db_url, min_size=concurrency, max_size=concurrency)

    latencies_ms: list[float] = []

    async def loop(count: int) -> None:
        for _ in range(count):
            began = time.perf_counter()
            await health.Check(health_pb2.HealthCheckRequest())
            async with pool.acquire() as conn:
                for _ in range(COMMITS):
                    await conn.execute(INSERT)
            await streamed_call(sdk, BENCH_REQUEST)
            latencies_ms.append((time.perf_counter() - began) * 1000)

    try:
        await asyncio.gather(*(loop(10) for _ in range(concurrency)))  # warm-up
        print("ready", flush=True)
        read_line = asyncio.get_running_loop().run_in_executor
        while await read_line(None, sys.stdin.readline):
            latencies_ms.clear()
            start, cpu_start = time.monotonic(), cpu_s(os.getpid())
            await asyncio.gather(*(loop(iterations // concurrency) for _ in range(concurrency)))
            span = {
                "start": start,
                "end": time.monotonic(),
                "cpu_s": cpu_s(os.getpid()) - cpu_start,
                "latencies_ms": latencies_ms,
            }
            print(json.dumps(span), flush=True)
    finally:
        await sdk.close()
        await channel.close()
        await pool.close()


if __name__ == "__main__":
    url, address, db, total, callers = sys.argv[1:6]
    run(_load(url, address, db, int(total), int(callers)))
