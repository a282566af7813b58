"""System-tier fixtures: the five services as real processes over loopback gRPC."""

from __future__ import annotations

import secrets
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest_asyncio

from services.interactions.sealing import Keyring
from tests.conftest import drop_database
from tests.durable_postgres import DurablePostgres
from tests.system.bad_input_support import hostile_stack  # noqa: F401  # bad-input modules' stack
from tests.system.stack_support import seeded_database
from tether import credentials
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
            "TETHER_SECRETS_KEY": Keyring.generate_setting(),
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


@dataclass(frozen=True)
class DurableServer:
    """A PostgreSQL server of one module's own, durable (tests.durable_postgres), with a
    migrated template database to clone."""

    postgres: DurablePostgres
    template_db: str

    @property
    def url(self) -> str:
        """The URL of its `postgres` database."""
        return self.postgres.server_url


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def durable_pg() -> AsyncIterator[DurableServer]:
    """A separate embedded PostgreSQL (fsync and synchronous commit on) with a migrated
    template database, for one module's drills."""
    # Not under pytest's tmp_path: the server runs as another user, who must reach the folder.
    data_dir = Path(tempfile.mkdtemp(prefix="tether-durable-pg-"))
    postgres = DurablePostgres(data_dir)
    try:
        await postgres.start()
        template = f"tether_tpl_{uuid.uuid4().hex[:12]}"
        await postgres.create_database(template)
        yield DurableServer(postgres, template)
    finally:
        postgres.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
