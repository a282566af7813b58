"""Shared benchmark plumbing: an isolated stack, latency stats and the JSON-lines output."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

from tether import apikeys, credentials
from tether.db.engine import create_engine
from tether.db.migrate import upgrade
from tether.stack.embedded import EmbeddedPostgres, EmbeddedRedis, database_url
from tether.stack.processes import ServiceSet


def emit(figure: str, value: float, unit: str, **config: Any) -> None:
    """Print one figure as a JSON line."""
    print(
        json.dumps({"figure": figure, "value": round(value, 3), "unit": unit, "config": config}),
        flush=True,
    )


def percentile(samples: list[float], q: float) -> float:
    """The q-th percentile (0..100) of samples, by the nearest-rank method."""
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


@dataclass
class LoadResult:
    """Throughput and latency of a closed-loop load."""

    ops: int
    seconds: float
    latencies_ms: list[float]

    @property
    def per_s(self) -> float:
        return self.ops / self.seconds

    @property
    def p50(self) -> float:
        return statistics.median(self.latencies_ms)

    @property
    def p99(self) -> float:
        return percentile(self.latencies_ms, 99)


async def closed_loop(
    op: Callable[[int, int], Awaitable[None]], *, callers: int, ops_per_caller: int
) -> LoadResult:
    """`callers` concurrent callers each running `op(caller, i)` `ops_per_caller` times."""
    latencies: list[float] = []

    async def caller(c: int) -> None:
        for i in range(ops_per_caller):
            start = time.perf_counter()
            await op(c, i)
            latencies.append((time.perf_counter() - start) * 1000)

    start = time.perf_counter()
    await asyncio.gather(*(caller(c) for c in range(callers)))
    return LoadResult(callers * ops_per_caller, time.perf_counter() - start, latencies)


@dataclass
class BenchStack:
    """Services on a fresh database with one tenant key."""

    services: ServiceSet
    db_url: str
    redis_url: str
    credentials: dict[str, str]
    api_key: str


@dataclass
class Servers:
    """The PostgreSQL server and Redis a bench runs against; `pg` and `redis` are set when the
    bench started them itself (embedded), None when the environment named them."""

    scratch: Path
    server_url: str
    redis_url: str
    pg: EmbeddedPostgres | None
    redis: EmbeddedRedis | None


@asynccontextmanager
async def bench_servers(*, embedded: bool = False) -> AsyncIterator[Servers]:
    """Embedded servers, or TETHER_DATABASE_URL / TETHER_REDIS_URL unless `embedded`."""
    scratch = Path(tempfile.mkdtemp(prefix="tether-bench-"))
    pg = redis = None
    server_url = "" if embedded else os.environ.get("TETHER_DATABASE_URL", "")
    redis_url = "" if embedded else os.environ.get("TETHER_REDIS_URL", "")
    try:
        if not server_url:
            pg = EmbeddedPostgres(scratch / "pg")
            server_url = await asyncio.to_thread(pg.start)
        if not redis_url:
            redis = EmbeddedRedis(scratch / "redis")
            redis_url = await redis.start()
        yield Servers(scratch, server_url, redis_url, pg, redis)
    finally:
        if redis is not None:
            redis.stop()
        if pg is not None:
            pg.stop()


@asynccontextmanager
async def bench_database(server_url: str) -> AsyncIterator[tuple[str, str]]:
    """A fresh, migrated database with the `bench` tenant: (its URL, a client key), dropped on
    exit."""
    name = f"tether_bench_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(server_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        db_url = database_url(server_url, name)
        try:
            await upgrade(db_url)
            engine = create_engine(db_url, pool_size=1)
            async with engine.begin() as conn:
                await apikeys.ensure_tenant(conn, "bench")
                key, _ = await apikeys.create_key(conn, "bench", "bench", apikeys.CLIENT_SCOPES)
            await engine.dispose()
            yield db_url, key
        finally:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


def service_set(
    run_dir: Path,
    db_url: str,
    redis_url: str,
    service_credentials: dict[str, str],
    extra_env: dict[str, str] | None = None,
    kind: type[ServiceSet] = ServiceSet,
) -> ServiceSet:
    """Services (not started) on `db_url` and `redis_url`, logging warnings only."""
    return kind(
        run_dir,
        {
            "TETHER_DATABASE_URL": db_url,
            "TETHER_REDIS_URL": redis_url,
            "TETHER_LOG_LEVEL": "WARNING",
            **(extra_env or {}),
        },
        service_credentials,
    )


@asynccontextmanager
async def bench_stack(
    names: tuple[str, ...] = ("orchestrator", "admission", "gateway"),
    extra_env: dict[str, str] | None = None,
) -> AsyncIterator[BenchStack]:
    """A stack on embedded servers (or TETHER_DATABASE_URL / TETHER_REDIS_URL)."""
    async with bench_servers() as servers, bench_database(servers.server_url) as (db_url, key):
        service_credentials = credentials.generate()
        services = service_set(
            servers.scratch / "run", db_url, servers.redis_url, service_credentials, extra_env
        )
        try:
            await services.start_all(names)
            yield BenchStack(services, db_url, servers.redis_url, service_credentials, key)
        finally:
            await services.stop_all()
