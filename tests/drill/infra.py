"""The soak's own world: a fresh PostgreSQL (fsync and synchronous commit on) and Redis in a
temp dir, the local model server, ledger and OAuth stand-in in this process, and the services
as real processes; plus the faults that act on the infrastructure itself (PostgreSQL killed
with an immediate shutdown and started again, Redis flushed and restarted)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import insert, update

from services.interactions.channel_store import ChannelSpec, ChannelStore
from services.interactions.sealing import Keyring
from services.orchestrator.agents import Agents
from tests.durable_postgres import DurablePostgres
from tether import apikeys, credentials
from tether.db.engine import create_engine
from tether.db.schema import grants, tenants
from tether.stack.embedded import EmbeddedRedis
from tether.stack.processes import ServiceSet
from tether.targets import TargetPolicy
from tether.testing.ledger import Ledger
from tether.testing.model_server import ModelServer
from tether.testing.oauth import OAuthServer
from tether.testing.slack_server import SlackServer

DATABASE = "tether_drill"

# Fast leases and retries so a 60-second soak sees many recoveries (as tests/system drills do).
FAST = {
    "TETHER_ORCHESTRATOR_LEASE_TTL_S": "1.5",
    "TETHER_ORCHESTRATOR_REAP_INTERVAL_S": "0.2",
    "TETHER_ORCHESTRATOR_CLAIM_POLL_S": "0.2",
    "TETHER_ORCHESTRATOR_RETRY_POLL_S": "0.05",
    "TETHER_WORKER_GRACE_S": "3",
    "TETHER_WORKER_ANTHROPIC_API_KEY": "drill-key",
    "TETHER_INTERACTIONS_SWEEP_INTERVAL_S": "0.5",
    "TETHER_LOG_LEVEL": "INFO",
}
LEASE_TTL_S = float(FAST["TETHER_ORCHESTRATOR_LEASE_TTL_S"])

TOOLS = ["get_time", "publish_post", "calendar_list_events", "ask_questions", "wait_until"]
# The agent a soak run's delegate calls start children of (issue 33): published with a route no
# message takes, so the tenant's own runs keep the soak's agent and only children run as it.
HELPER = {"name": "helper", "routes": [{"channel": "drill-delegation-only"}]}
PRINCIPAL = "drill-user"
# The flood tenant's agent's cap on runs at once (`limits.max_running`): a third of the pool of
# three workers' 8 slots each.
FLOOD_AGENT_CAP = 8
BACKEND = ("orchestrator", "admission", "interactions")


@dataclass(frozen=True)
class DrillTenant:
    """A tenant of the soak and its client key; `granted` tenants hold a tenant-wide standing
    grant for publish_post, the others are asked for approval."""

    tenant_id: str
    api_key: str
    granted: bool


async def provision_tenant(
    db_url: str, index: int | str, *, granted: bool, max_running: int = 0
) -> DrillTenant:
    """Create tenant `index` (a number, or a name such as "flood") with the soak's agent (capped
    at `max_running` runs at once, if given) and a client key (one place, so a change in how
    keys and principals are made is adapted here only)."""
    tenant_id = f"drill-{index}-{uuid.uuid4().hex[:6]}"
    limits: dict[str, float] = {"backoff_initial_seconds": 0.05, "backoff_max_seconds": 0.5}
    if max_running:
        limits["max_running"] = max_running
    agent = {
        "tool_allowlist": TOOLS,
        "limits": limits,
        "delegation": {"agents": [HELPER["name"]]},
    }
    engine = create_engine(db_url, pool_size=1)
    try:
        async with engine.begin() as conn:
            await apikeys.ensure_tenant(conn, tenant_id)
            await conn.execute(
                update(tenants).where(tenants.c.tenant_id == tenant_id).values(agent=agent)
            )
            if granted:
                await conn.execute(
                    insert(grants).values(
                        grant_id=f"grt_{uuid.uuid4().hex}",
                        tenant_id=tenant_id,
                        scope="tenant",
                        tool_name="publish_post",
                        granted_by="drill-admin",
                    )
                )
            key, _ = await apikeys.create_key(conn, tenant_id, PRINCIPAL, apikeys.CLIENT_SCOPES)
        await Agents(engine).apply(
            tenant_id, json.dumps(HELPER), {"key_id": "drill", "principal_id": PRINCIPAL}
        )
    finally:
        await engine.dispose()
    return DrillTenant(tenant_id, key, granted)


async def connect_slack(
    db_url: str, secrets_key: str, slack: SlackServer, tenants_list: list[DrillTenant]
) -> dict[str, tuple[str, str]]:
    """A Slack connection per tenant, answering to the stand-in, stored as interactions stores
    one (its channel id and signing secret by tenant)."""
    engine = create_engine(db_url, pool_size=1)
    store = ChannelStore(engine, Keyring.parse(secrets_key), TargetPolicy.parse("loopback"))
    connections = {}
    try:
        for tenant in tenants_list:
            signing = f"drill-signing-{uuid.uuid4().hex}"
            added = await store.add(
                tenant.tenant_id,
                "drill-admin",
                ChannelSpec(
                    kind="slack",
                    name="drill-slack",
                    api_base_url=slack.api_url,
                    secrets={
                        "signing_secret": signing.encode(),
                        "bot_token": slack.bot_token.encode(),
                    },
                ),
            )
            connections[tenant.tenant_id] = (added.channel_id, signing)
    finally:
        await engine.dispose()
    return connections


@dataclass
class World:
    """Everything the soak runs against."""

    services: ServiceSet
    postgres: DurablePostgres
    redis: EmbeddedRedis
    db_url: str
    model: ModelServer
    ledger: Ledger
    oauth: OAuthServer
    tenants: list[DrillTenant]
    slack: SlackServer
    # tenant id -> its Slack connection's (channel id, signing secret)
    slack_connections: dict[str, tuple[str, str]]
    # The tenant flooding the pool and a quiet one beside it (tests.drill.flood_load), apart
    # from `tenants`.
    flood_tenant: DrillTenant
    quiet_tenant: DrillTenant

    def gateways(self) -> list[str]:
        """host:port of every gateway replica."""
        return [p.address for n, p in self.services.procs.items() if n.startswith("gateway")]

    def gateway_http(self) -> list[str]:
        """host:port of every gateway replica's HTTP side (where providers' webhooks arrive)."""
        return [a for n, a in self.services.http_addresses().items() if n.startswith("gateway")]

    async def restart_redis(self, *, flush: bool) -> None:
        """FLUSHALL (every hint gone), then stop the server and start it on the same port."""
        if flush:
            import redis.asyncio as redis

            client = redis.Redis.from_url(self.redis.url)
            try:
                await client.flushall()
            finally:
                await client.aclose()
        await asyncio.to_thread(self.redis.stop)
        await self.redis.start()


@asynccontextmanager
async def world(
    work_dir: Path, *, workers: int, tenants_count: int, gateways: int = 2
) -> AsyncIterator[World]:
    """Start the soak's world in `work_dir`; stops everything on the way out."""
    postgres = DurablePostgres(work_dir / "pg")
    redis_server = EmbeddedRedis(work_dir / "redis")
    model, ledger, oauth = ModelServer(), Ledger(), OAuthServer()
    slack = SlackServer()
    secrets_key = credentials.new_secrets_key()
    services: ServiceSet | None = None
    try:
        await postgres.start()
        db_url = await postgres.create_database(DATABASE)
        await redis_server.start()
        for server in (model, ledger, oauth, slack):
            await server.start()
        env: dict[str, Any] = {
            "TETHER_DATABASE_URL": db_url,
            "TETHER_REDIS_URL": redis_server.url,
            "TETHER_WORKER_ANTHROPIC_BASE_URL": model.base_url,
            "TETHER_TOOL_LEDGER_URL": ledger.base_url,
            "TETHER_INTERACTIONS_OAUTH_BASE_URL": oauth.base_url,
            "TETHER_INTERACTIONS_OAUTH_REDIRECT_URI": "http://127.0.0.1/v1/oauth/callback",
            # The consents the load completes seal their tokens.
            credentials.SECRETS_KEY_ENV: secrets_key,
            # Channel answers go to the Slack stand-in on loopback.
            "TETHER_ALLOW_PRIVATE_TARGETS": "loopback",
            **FAST,
        }
        services = ServiceSet(work_dir / "run", env, credentials.generate())
        await services.start_all(("orchestrator", "admission", "interactions"))
        # The last wave together: every gateway replica and worker calls only the services up.
        await asyncio.gather(
            *(services.start("gateway", instance=gateway_name(i)) for i in range(gateways)),
            *(start_worker(services) for _ in range(workers)),
        )
        tenants_list = list(
            await asyncio.gather(
                *(provision_tenant(db_url, i, granted=i % 2 == 0) for i in range(tenants_count))
            )
        )
        connections = await connect_slack(db_url, secrets_key, slack, tenants_list)
        # The flood's agent is capped below the pool: most of its backlog is held back by the
        # cap (marked held, probed as it has room) while the quiet tenant's runs go by.
        flood_tenant = await provision_tenant(
            db_url, "flood", granted=False, max_running=FLOOD_AGENT_CAP
        )
        quiet_tenant = await provision_tenant(db_url, "quiet", granted=False)
        yield World(
            services,
            postgres,
            redis_server,
            db_url,
            model,
            ledger,
            oauth,
            tenants_list,
            slack,
            connections,
            flood_tenant,
            quiet_tenant,
        )
    finally:
        if services is not None:
            for proc in services.procs.values():
                if proc.process.poll() is None:
                    proc.process.send_signal(18)  # SIGCONT: a frozen worker must hear SIGTERM
            await services.stop_all(grace=5)
        for server in (model, ledger, oauth, slack):
            await server.stop()
        redis_server.stop()
        postgres.stop()


_worker_numbers = iter(range(1, 1_000_000))


def gateway_name(index: int) -> str:
    """Instance name of gateway replica `index` (from 0), as ServiceSet numbers them."""
    return "gateway" if index == 0 else f"gateway-{index + 1}"


async def start_worker(services: ServiceSet, *, timeout: float = 120.0) -> str:
    """Start one more worker with a lease-owner name the soak can find in `runs.lease_owner`;
    returns its instance name (which is also that lease-owner name)."""
    name = f"worker-w{next(_worker_numbers)}"
    proc = await services.start(
        "worker", instance=name, extra_env={"TETHER_WORKER_WORKER_ID": name}, timeout=timeout
    )
    return proc.name
