"""System-tier fixtures: the five services as real processes over loopback gRPC."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest_asyncio

from tests.conftest import clone_database, drop_database
from tests.system.bad_input_support import hostile_stack  # noqa: F401  # bad-input modules' stack
from tether import apikeys
from tether.db.engine import create_engine
from tether.stack.embedded import database_url
from tether.stack.processes import ServiceSet


@dataclass
class RunningStack:
    """Services on a fresh database, with keys for two tenants."""

    services: ServiceSet
    db_url: str
    service_token: str
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
    name = await clone_database(pg_server_url, template_db)
    db_url = database_url(pg_server_url, name)
    engine = create_engine(db_url, pool_size=1)
    async with engine.begin() as conn:
        for tenant in ("tenant-a", "tenant-b", "ops"):
            await apikeys.ensure_tenant(conn, tenant)
        admin_key, _ = await apikeys.create_key(conn, "ops", "root", apikeys.ALL_SCOPES)
        key_a, _ = await apikeys.create_key(conn, "tenant-a", "alice", apikeys.CLIENT_SCOPES)
        key_b, _ = await apikeys.create_key(conn, "tenant-b", "bob", apikeys.CLIENT_SCOPES)
        read_only, _ = await apikeys.create_key(conn, "tenant-a", "auditor", ["runs:read"])
    await engine.dispose()
    token = secrets.token_urlsafe(16)
    run_dir = Path(tmp_path_factory.mktemp("run"))  # type: ignore[attr-defined]
    services = ServiceSet(
        run_dir,
        {
            "TETHER_DATABASE_URL": db_url,
            "TETHER_REDIS_URL": redis_url,
            "TETHER_SERVICE_TOKEN": token,
        },
    )
    try:
        # No worker here: these tests look at admission and the API, with runs left queued.
        await services.start_all(("orchestrator", "admission", "interactions", "gateway"))
        yield RunningStack(services, db_url, token, admin_key, key_a, key_b, read_only)
    finally:
        await services.stop_all()
        await drop_database(pg_server_url, name)


@pytest_asyncio.fixture(loop_scope="session")
async def gateway_channel(stack: RunningStack) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(stack.gateway) as channel:
        yield channel
