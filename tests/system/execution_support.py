"""Support for the durable-execution tests: a stack with workers, a scripted model server and
a ledger, plus helpers to create tenants with their own agent limits and to observe runs."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from sqlalchemy import insert, select, update

from services.interactions.sealing import Keyring
from services.orchestrator.repositories.answers import READ_RUN
from tests.conftest import clone_database, drop_database
from tether import apikeys, credentials
from tether.db.engine import create_engine
from tether.db.schema import grants, run_event_log, run_parts, runs, tenants
from tether.stack.embedded import database_url
from tether.stack.processes import ServiceSet
from tether.testing.eventually import eventually
from tether.testing.ledger import Ledger
from tether.testing.model_server import ModelServer, RateLimits
from tether.testing.oauth import OAuthServer
from tether.v1 import gateway_pb2, gateway_pb2_grpc

FAST = {
    "TETHER_ORCHESTRATOR_LEASE_TTL_S": "1.5",
    "TETHER_ORCHESTRATOR_REAP_INTERVAL_S": "0.2",
    "TETHER_ORCHESTRATOR_CLAIM_POLL_S": "0.2",
    "TETHER_ORCHESTRATOR_RETRY_POLL_S": "0.02",
    "TETHER_WORKER_GRACE_S": "3",
    "TETHER_WORKER_ANTHROPIC_API_KEY": "test-key",
    "TETHER_TOOL_SLOW_TASK_TIMEOUT_S": "120",
    "TETHER_LOG_LEVEL": "INFO",
}

TOOLS = [
    "get_time",
    "publish_post",
    "slow_task",
    "big_output",
    "fail_tool",
    "calendar_list_events",
    "ask_questions",
    "request_approval",
]


@dataclass
class ExecStack:
    """Running services (workers started by the test), a model server and a ledger."""

    services: ServiceSet
    db_url: str
    model: ModelServer
    ledger: Ledger
    credentials: dict[str, str]
    oauth: OAuthServer

    def addr(self, name: str) -> str:
        return self.services.addresses()[name]

    async def start_worker(self, **env: str) -> str:
        proc = await self.services.start("worker", extra_env=env)
        return proc.name

    async def tenant(
        self,
        *,
        grant: Sequence[str] = (),
        policy: dict[str, Any] | None = None,
        agent: dict[str, Any] | None = None,
        scopes: Sequence[str] = apikeys.CLIENT_SCOPES,
        tenant_id: str | None = None,
        **limits: Any,
    ) -> Tenant:
        """A fresh tenant (named `tenant_id`, else at random) whose agent has `limits` (over
        fast-retry test defaults) and the rest of `agent`, with tenant-wide standing grants for
        the tools in `grant`, and a key with `scopes`."""
        tenant_id = tenant_id or f"t-{uuid.uuid4().hex[:10]}"
        agent = {
            "tool_allowlist": TOOLS,
            **(agent or {}),
            "limits": {"backoff_initial_seconds": 0.05, "backoff_max_seconds": 0.2, **limits},
        }
        engine = create_engine(self.db_url, pool_size=1)
        try:
            async with engine.begin() as conn:
                await apikeys.ensure_tenant(conn, tenant_id)
                await conn.execute(
                    update(tenants)
                    .where(tenants.c.tenant_id == tenant_id)
                    .values(agent=agent, policy=policy or {})
                )
                for tool in grant:
                    await conn.execute(
                        insert(grants).values(
                            grant_id=f"grt_{uuid.uuid4().hex}",
                            tenant_id=tenant_id,
                            scope="tenant",
                            tool_name=tool,
                            granted_by="test-admin",
                        )
                    )
                key, _ = await apikeys.create_key(conn, tenant_id, "tester", scopes)
        finally:
            await engine.dispose()
        return Tenant(self, tenant_id, key)


@dataclass
class Tenant:
    """A tenant of the stack, with an API key and helpers over its runs."""

    stack: ExecStack
    tenant_id: str
    api_key: str

    def stub(self, channel: grpc.aio.Channel) -> gateway_pb2_grpc.GatewayServiceStub:
        return gateway_pb2_grpc.GatewayServiceStub(channel)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),)

    async def send(self, text: str, conversation: str | None = None) -> str:
        async with grpc.aio.insecure_channel(self.stack.addr("gateway")) as channel:
            response = await self.stub(channel).SendMessage(
                gateway_pb2.SendMessageRequest(
                    text=text,
                    conversation_id=conversation or f"c-{uuid.uuid4().hex[:8]}",
                    event_id=f"e-{uuid.uuid4().hex}",
                ),
                metadata=self.metadata,
            )
        return str(response.run.run_id)

    async def cancel(self, run_id: str) -> gateway_pb2.CancelRunResponse:
        async with grpc.aio.insecure_channel(self.stack.addr("gateway")) as channel:
            response: gateway_pb2.CancelRunResponse = await self.stub(channel).CancelRun(
                gateway_pb2.CancelRunRequest(run_id=run_id, reason="test cancel"),
                metadata=self.metadata,
            )
        return response


async def run_row(db_url: str, run_id: str) -> Any:
    """The run's row as every reader takes it (`READ_RUN`: a completed run's answer from its
    parts when they hold it, stored format 5)."""
    engine = create_engine(db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            return (await conn.execute(select(*READ_RUN).where(runs.c.run_id == run_id))).one()
    finally:
        await engine.dispose()


async def events_of(db_url: str, run_id: str) -> list[tuple[int, str, dict[str, Any]]]:
    engine = create_engine(db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(run_event_log.c.seq, run_event_log.c.type, run_event_log.c.payload)
                    .where(run_event_log.c.run_id == run_id)
                    .order_by(run_event_log.c.seq)
                )
            ).all()
    finally:
        await engine.dispose()
    return [(r.seq, r.type, dict(r.payload)) for r in rows]


async def parts_of(db_url: str, run_id: str) -> list[Any]:
    engine = create_engine(db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            return list(
                (
                    await conn.execute(
                        select(run_parts)
                        .where(run_parts.c.run_id == run_id)
                        .order_by(run_parts.c.part_index)
                    )
                ).all()
            )
    finally:
        await engine.dispose()


async def wait_for_status(db_url: str, run_id: str, *statuses: str, timeout: float = 20.0) -> Any:
    async def probe() -> Any:
        row = await run_row(db_url, run_id)
        return row if row.status in statuses else None

    return await eventually(
        probe, timeout=timeout, interval=0.05, what=f"run {run_id} to reach {statuses}"
    )


@asynccontextmanager
async def exec_stack(
    pg_server_url: str,
    template_db: str,
    redis_url: str,
    run_dir: Path,
    *,
    workers: int,
    extra_env: dict[str, str] | None = None,
    model_limits: RateLimits | None = None,
) -> AsyncIterator[ExecStack]:
    """A fresh database and services, with `workers` workers started (and the model server
    enforcing `model_limits`, when given)."""
    name = await clone_database(pg_server_url, template_db)
    db_url = database_url(pg_server_url, name)
    service_credentials = credentials.generate()
    model = ModelServer(limits=model_limits)
    ledger = Ledger()
    oauth = OAuthServer()
    await model.start()
    await ledger.start()
    await oauth.start()
    env = {
        "TETHER_DATABASE_URL": db_url,
        "TETHER_REDIS_URL": redis_url,
        "TETHER_WORKER_ANTHROPIC_BASE_URL": model.base_url,
        "TETHER_TOOL_LEDGER_URL": ledger.base_url,
        "TETHER_INTERACTIONS_OAUTH_BASE_URL": oauth.base_url,
        "TETHER_INTERACTIONS_OAUTH_REDIRECT_URI": "http://127.0.0.1/v1/oauth/callback",
        "TETHER_INTERACTIONS_SWEEP_INTERVAL_S": "0.2",
        "TETHER_SECRETS_KEY": Keyring.generate_setting(),
        **FAST,
        **(extra_env or {}),
    }
    services = ServiceSet(run_dir, env, service_credentials)
    try:
        await services.start_all(("orchestrator", "admission", "interactions", "gateway"))
        stack = ExecStack(services, db_url, model, ledger, service_credentials, oauth)
        for _ in range(workers):
            await stack.start_worker()
        yield stack
    finally:
        await services.stop_all(grace=5)
        await model.stop()
        await ledger.stop()
        await oauth.stop()
        await drop_database(pg_server_url, name)


def dump(value: Any) -> str:
    return json.dumps(value, default=str, indent=1)
