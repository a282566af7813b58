"""System-tier fixtures: the five services as real processes over loopback gRPC."""

from __future__ import annotations

import contextlib
import secrets
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import asyncpg
import grpc
import pytest_asyncio

from tests.conftest import drop_database
from tests.system.bad_input_support import hostile_stack  # noqa: F401  # bad-input modules' stack
from tests.system.stack_support import seeded_database
from tether import credentials
from tether.db.migrate import upgrade
from tether.stack.embedded import EmbeddedPostgres, database_url
from tether.stack.processes import ServiceSet


@dataclass
class RunningStack:
    """Services on a fresh database, with keys for two tenants."""

    services: ServiceSet
    db_url: str
    credentials: dict[str, str]
    operator_credential: str
    admin_key: str
    key_a: str
    key_b: str
    read_only_key: str

    @property
    def gateway(self) -> str:
        return self.services.addresses()["gateway"]

    def metadata(self, key: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {key}"),)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: object
) -> AsyncIterator[RunningStack]:
    seeded = await seeded_database(pg_server_url, template_db)
    service_credentials = credentials.generate()
    operator = "top_" + secrets.token_urlsafe(32)
    run_dir = Path(tmp_path_factory.mktemp("run"))  # type: ignore[attr-defined]
    services = ServiceSet(
        run_dir,
        {
            "TETHER_DATABASE_URL": seeded.url,
            "TETHER_REDIS_URL": redis_url,
            "TETHER_GATEWAY_OPERATOR_CREDENTIAL_SHA256": credentials.verifier(operator),
        },
        service_credentials,
    )
    try:
        # No worker here: these tests look at admission and the API, with runs left queued.
        await services.start_all(("orchestrator", "admission", "interactions", "gateway"))
        yield RunningStack(
            services,
            seeded.url,
            service_credentials,
            operator,
            seeded.admin_key,
            seeded.key_a,
            seeded.key_b,
            seeded.read_only_key,
        )
    finally:
        await services.stop_all()
        await drop_database(pg_server_url, seeded.name)


@pytest_asyncio.fixture(loop_scope="session")
async def gateway_channel(stack: RunningStack) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(stack.gateway) as channel:
        yield channel


@dataclass
class DurablePostgres:
    """A PostgreSQL server of its own, with the defaults (fsync and synchronous commit on), for
    drills that kill it: a durability claim needs durable storage, and the suite's shared test
    server trades crash safety for speed. Never the server named by TETHER_DATABASE_URL."""

    server: EmbeddedPostgres
    url: str
    template_db: str

    def _pg_ctl(self, *args: str) -> None:
        from pgserver._commands import pg_ctl

        handle = self.server._server
        pg_ctl(list(args), pgdata=handle.pgdata, user=handle.system_user, timeout=60)  # type: ignore[attr-defined]

    def kill(self) -> None:
        """Immediate shutdown: every backend dies at once, nothing is flushed (crash recovery
        runs on the next start)."""
        self._pg_ctl("-w", "-m", "immediate", "stop")

    def restart(self) -> None:
        """Start it again on the same socket, so every client's URL still works."""
        socket_dir = parse_qs(urlsplit(self.url).query)["host"][0]
        handle = self.server._server
        self._pg_ctl(
            "-w",
            "-o",
            '-h ""',
            "-o",
            f"-k {socket_dir}",
            "-l",
            str(handle.pgdata / "log"),  # type: ignore[attr-defined]
            "start",
        )


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def durable_pg() -> AsyncIterator[DurablePostgres]:
    """A separate embedded PostgreSQL (fsync and synchronous commit on) with a migrated
    template database, for one module's drills."""
    # Not under pytest's tmp_path: the server runs as another user, who must reach the folder.
    data_dir = Path(tempfile.mkdtemp(prefix="tether-durable-pg-"))
    server = EmbeddedPostgres(data_dir)
    url = server.start()
    template = f"tether_tpl_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(url)
    try:
        await admin.execute(f'CREATE DATABASE "{template}"')
    finally:
        await admin.close()
    await upgrade(database_url(url, template))
    durable = DurablePostgres(server, url, template)
    try:
        yield durable
    finally:
        # After a kill and restart pgserver's handle knows only the dead postmaster.
        with contextlib.suppress(subprocess.CalledProcessError):
            durable._pg_ctl("-w", "-m", "fast", "stop")
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
