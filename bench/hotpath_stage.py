"""What every hot-path stage runs on: the embedded servers, the local model, a fresh database
with the services (and workers) on it, and the CPU meter over all of their processes."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import redis.asyncio as redis

from bench.common import Servers, bench_database, service_set
from bench.cpu import CpuMeter
from bench.model import Model
from bench.runs import SERVICES, WORKERS, worker_env
from tether import credentials
from tether.client import TetherClient
from tether.stack.processes import ServiceSet, instance_name, service_of

# Roles that are not the stack: the stand-in for the model provider and the load generator.
NOT_THE_STACK = ("model_server", "bench")


@dataclass
class Stage:
    """Services on a fresh database, with a client of the gateway."""

    services: ServiceSet
    db_url: str
    redis_url: str
    api_key: str
    client: TetherClient
    model: Model

    @property
    def database(self) -> str:
        return unquote(urlsplit(self.db_url).path.lstrip("/"))

    async def add_workers(self, count: int) -> list[str]:
        """Start `count` more workers at once; their instance names."""
        taken = set(self.workers())
        names = [n for n in (instance_name("worker", i) for i in range(1, 64)) if n not in taken]
        await asyncio.gather(
            *(
                self.services.start("worker", extra_env=worker_env(self.model), instance=name)
                for name in names[:count]
            )
        )
        return names[:count]

    def workers(self) -> list[str]:
        """Instance names of the workers that run."""
        return [
            name
            for name, proc in self.services.procs.items()
            if service_of(name) == "worker" and proc.process.poll() is None
        ]


@asynccontextmanager
async def stage(
    servers: Servers,
    model: Model,
    *,
    names: tuple[str, ...] = SERVICES,
    workers: int = WORKERS,
    kind: type[ServiceSet] = ServiceSet,
) -> AsyncIterator[Stage]:
    """`names` and `workers` workers on a fresh database; all stopped on exit."""
    async with bench_database(servers.server_url) as (db_url, key):
        services = service_set(
            servers.scratch / f"run-{uuid.uuid4().hex[:8]}",
            db_url,
            servers.redis_url,
            credentials.generate(),
            kind=kind,
        )
        try:
            await services.start_all(names)
            async with TetherClient(services.addresses()["gateway"], key) as client:
                current = Stage(services, db_url, servers.redis_url, key, client, model)
                await current.add_workers(workers)
                yield current
        finally:
            await services.stop_all()


def postmaster_pid(servers: Servers) -> int:
    """The embedded PostgreSQL's postmaster (the first line of its postmaster.pid)."""
    assert servers.pg is not None, "the hot-path bench runs on its own embedded servers"
    return int((servers.pg.data_dir / "postmaster.pid").read_text().split()[0])


def server_log(servers: Servers) -> Path:
    """Where the embedded PostgreSQL writes its log (pgserver starts it with `pg_ctl -l`)."""
    assert servers.pg is not None, "the hot-path bench runs on its own embedded servers"
    path = servers.pg.data_dir / "log"
    if not path.exists():
        raise RuntimeError(f"no PostgreSQL log at {path}")
    return path


async def redis_pid(redis_url: str) -> int:
    """The Redis server's process id, as it reports it."""
    client = redis.Redis.from_url(redis_url)
    try:
        return int((await client.info("server"))["process_id"])
    finally:
        await client.aclose()


def cpu_meter(servers: Servers, current: Stage, redis_process: int) -> CpuMeter:
    """CPU of every process: each service (the workers together), PostgreSQL (the postmaster
    and every backend, ended ones too), Redis, the model server and this bench."""
    postmaster = postmaster_pid(servers)

    def roles() -> dict[str, list[int]]:
        found: dict[str, list[int]] = defaultdict(list)
        for name, proc in current.services.procs.items():
            if proc.process.poll() is None:
                found[service_of(name)].append(proc.process.pid)
        found["postgres"] = [postmaster]
        found["redis"] = [redis_process]
        found["model_server"] = [current.model.pid]
        found["bench"] = [os.getpid()]
        return found

    return CpuMeter(roles, trees=frozenset({"postgres"}))


def ms_by_role(by_role: dict[str, float], per: float) -> dict[str, float]:
    """CPU seconds by role as ms per `per` (a run, an iteration), largest first."""
    ordered = sorted(by_role.items(), key=lambda kv: -kv[1])
    return {role: round(seconds * 1000 / per, 3) for role, seconds in ordered}


def top(counts: dict[str, int], per: float, limit: int) -> dict[str, float]:
    """The `limit` largest counts, each divided by `per`, largest first."""
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]
    return {key: round(value / per, 3) for key, value in ordered}
