"""The migrations Job gates a rollout: services started on a database one migration behind the
release they ship stay alive but not ready (gRPC health NOT_SERVING) and run no background
work, and turn ready once the Job's migration lands, with no restart."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from alembic.script import ScriptDirectory
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import create_database, drop_database
from tether import apikeys, credentials
from tether.db.engine import create_engine
from tether.db.migrate import alembic_config, shipped_revisions, upgrade
from tether.runtime.rpc import LIVENESS
from tether.stack.embedded import database_url
from tether.stack.processes import ServiceSet, wait_serving
from tether.testing.eventually import eventually
from tether.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

# Slow: services started a migration behind, then migrated under them (make slow).
pytestmark = pytest.mark.slow

# The services that read the database, each gated on its schema (the worker has none).
GATED = ("orchestrator", "admission", "interactions", "gateway")
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


def previous_revision() -> str:
    """The revision just before this release's head."""
    head, _ = shipped_revisions()
    previous = ScriptDirectory.from_config(alembic_config()).get_revision(head).down_revision
    assert isinstance(previous, str)
    return previous


@pytest_asyncio.fixture(loop_scope="session")
async def behind_db(pg_server_url: str) -> AsyncIterator[str]:
    """A database migrated to one revision before this release's head."""
    name = await create_database(pg_server_url)
    url = database_url(pg_server_url, name)
    await upgrade(url, previous_revision())
    yield url
    await drop_database(pg_server_url, name)


async def health_of(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return int(response.status)


async def test_services_are_not_ready_until_the_schema_is_at_their_release(
    behind_db: str, redis_url: str, tmp_path: Path
) -> None:
    services = ServiceSet(
        tmp_path,
        {"TETHER_DATABASE_URL": behind_db, "TETHER_REDIS_URL": redis_url},
        credentials.generate(),
    )
    try:
        for name in GATED:
            await services.start(
                name, extra_env={f"TETHER_{name.upper()}_HEALTH_PORT": "0"}, until_ready=False
            )
        procs = [services.procs[name] for name in GATED]
        for proc in procs:
            # Alive (the liveness and startup probes pass) but not ready, on both ports.
            assert await health_of(proc.health_address, LIVENESS) == SERVING, proc.name
            assert await health_of(proc.health_address) == NOT_SERVING, proc.name
            assert await health_of(proc.address) == NOT_SERVING, proc.name
        needs = f"this release needs {shipped_revisions()[0]}"
        for proc in procs:
            # Each looked at the schema and says what it waits for.
            await eventually(
                lambda proc=proc: _logged(proc.log_path, needs), what=f"{proc.name} to say so"
            )
        # The orchestrator waits with its rounds too: nothing of its ran against the old schema.
        assert "round failed" not in services.procs["orchestrator"].log_path.read_text()

        await upgrade(behind_db)  # what the migrations Job runs
        await asyncio.gather(*(wait_serving(p.health_address, timeout=30) for p in procs))
        for proc in procs:
            assert proc.process.poll() is None, f"{proc.name} turned ready without a restart"

        key = await _client_key(behind_db)
        async with grpc.aio.insecure_channel(services.addresses()["gateway"]) as channel:
            sent = await gateway_pb2_grpc.GatewayServiceStub(channel).SendMessage(
                gateway_pb2.SendMessageRequest(
                    text="after the migration", conversation_id="c", event_id="e-1"
                ),
                metadata=(("authorization", f"Bearer {key}"),),
            )
        assert sent.run.status == common_pb2.RUN_STATUS_QUEUED
    finally:
        await services.stop_all()


async def _logged(path: Path, text: str) -> bool:
    return text in await asyncio.to_thread(path.read_text)


async def _client_key(url: str) -> str:
    engine = create_engine(url, pool_size=1)
    try:
        async with engine.begin() as conn:
            await apikeys.ensure_tenant(conn, "tenant-a")
            key, _ = await apikeys.create_key(conn, "tenant-a", "alice", apikeys.CLIENT_SCOPES)
    finally:
        await engine.dispose()
    return key
