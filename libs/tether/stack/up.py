"""`tether up`: the whole stack on embedded defaults, until Ctrl-C.

Data lives in one folder (TETHER_DATA_DIR, default `.tether/`): PostgreSQL's data, Redis's
working dir, service logs, the platform operator's credential and `stack.json`, which tells
clients where the gateway is and which development key (and operator credential) to use, and
names every service's address and pid. Each service gets a credential of its own, new at every
start. `TETHER_WORKERS` worker processes (default 2) run; a service that dies is restarted on
its own ports, and so are PostgreSQL and Redis on theirs (`tether.stack.supervisor`).
Starting again on the same folder keeps every run, key and event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import grpc

from tether import agent_spec, apikeys, credentials
from tether.client import TetherClient
from tether.db.engine import create_engine
from tether.db.migrate import upgrade
from tether.errors import InvalidArgument
from tether.retry import RetryPolicy
from tether.runtime.process import wait_for_signal
from tether.stack import demo_mcp, demo_slack
from tether.stack.demo_mcp import McpStandIn
from tether.stack.demo_slack import SlackStandIn
from tether.stack.embedded import EmbeddedRedis, database_url, worker_redis_user
from tether.stack.postgres import ChildPostgres
from tether.stack.processes import ServiceProcess, ServiceSet
from tether.stack.settings import UpSettings
from tether.stack.supervisor import ServiceSupervisor
from tether.targets import SETTING as TARGETS_SETTING

log = logging.getLogger(__name__)

DEV_TENANT = "dev"
DEV_PRINCIPAL = "dev"
DATABASE = "tether"
# Marks the operator's credential apart from API keys (tk_) at a glance.
OPERATOR_PREFIX = "top_"
# The example agents a new user sees on the first day (the demo, and one routed by channel).
EXAMPLE_AGENTS = Path(__file__).resolve().parents[3] / "examples" / "agents"


async def ensure_database(server_url: str, name: str) -> str:
    """Create database `name` on the server when missing; returns its URL."""
    conn = await asyncpg.connect(server_url)
    try:
        exists = await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name)
        if not exists:
            await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return database_url(server_url, name)


def _read_secret(path: Path, prefix: str = "") -> str:
    if path.exists():
        return path.read_text().strip()
    value = prefix + secrets.token_urlsafe(32)
    path.write_text(value)
    path.chmod(0o600)
    return value


def _secrets_key(path: Path) -> str:
    """The dev stack's TETHER_SECRETS_KEY, generated once: secrets sealed under it stay
    readable across restarts. Created owner-only (never readable by others, not even for the
    moment between writing and a chmod)."""
    if path.exists():
        return path.read_text().strip()
    setting = credentials.new_secrets_key("dev1")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(setting)
    return setting


async def dev_key(db_url: str, previous: dict[str, Any]) -> str:
    """The development tenant's admin key: the previous one if still valid, else a new one."""
    engine = create_engine(db_url, pool_size=1, application="stack")
    try:
        async with engine.begin() as conn:
            old = previous.get("api_key")
            found = await apikeys.find_key(conn, old) if isinstance(old, str) else None
            # A key from before a scope was named (keys:admin, agents:write) lacks it: replace it.
            if (
                isinstance(old, str)
                and found is not None
                and set(apikeys.ALL_SCOPES) <= set(found.scopes)
            ):
                return old
            await apikeys.ensure_tenant(conn, DEV_TENANT)
            key, _ = await apikeys.create_key(conn, DEV_TENANT, DEV_PRINCIPAL, apikeys.ALL_SCOPES)
            return key
    finally:
        await engine.dispose()


async def apply_agents(
    gateway: str, api_key: str, folder: Path, *, mcp_url: str | None = None
) -> list[tuple[str, int, bool]]:
    """Apply every agent document in `folder` (in name order, so the first is the tenant's
    default when it has none) whose agent the tenant does not have yet: (name, version,
    created) each. An agent it has is left as it is, so a change made with the CLI or the
    console survives a restart. A refused document is logged and skipped: the stack serves
    without it. `${TETHER_DEMO_MCP_URL}` in a document is the demo MCP server's URL
    (`mcp_url`)."""
    if not folder.is_dir():
        log.info("no agent documents at %s to apply", folder)
        return []
    applied = []
    async with TetherClient(gateway, api_key) as client:
        if not await _catalog_announced(client):
            log.warning("no worker announced its tools within %.0f s", CATALOG_WAIT_S)
        held = {agent.name for agent in (await client.list_agents()).agents}
        for path in sorted(folder.iterdir()):
            if path.suffix not in (".yaml", ".yml", ".json"):
                continue
            text = demo_mcp.resolve(path.read_text(), mcp_url)
            try:
                name = agent_spec.parse(text).name
            except InvalidArgument as exc:
                log.warning("agent %s not applied: %s", path.name, exc)
                continue
            if name in held:
                log.info("agent %s kept as the tenant has it (%s not applied)", name, path.name)
                continue
            try:
                answer = await client.apply_agent(text)
            except grpc.aio.AioRpcError as exc:
                log.warning("agent %s not applied: %s", path.name, exc.details())
                continue
            applied.append((answer.name, answer.version, answer.created))
            log.info("agent %s at version %d from %s", answer.name, answer.version, path.name)
    return applied


# How long the examples wait for the tool catalog: a ready worker's hello is recorded beside its
# stream, a moment after the worker says it is ready, and an apply naming tools before any is
# recorded is refused (tool_catalog_empty).
CATALOG_WAIT_S = 15.0
CATALOG_POLL_S = 0.1


async def _catalog_announced(client: TetherClient) -> bool:
    """Whether the tool catalog holds a tool, waiting up to CATALOG_WAIT_S for one."""
    deadline = asyncio.get_running_loop().time() + CATALOG_WAIT_S
    while not (await client.list_tools()).tools:
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(CATALOG_POLL_S)
    return True


def http_port_for(previous: dict[str, Any]) -> int:
    """The gateway's HTTP port: the one the stack had before when it is free (so the console's
    URL stays the same across restarts), else a free one. Chosen here, before any service
    starts, because the interactions service is told where a login comes back to."""
    _, _, before = str(previous.get("http", "")).rpartition(":")
    for port in (int(before) if before.isdigit() else 0, 0):
        with socket.socket() as probe:
            # As the gateway binds it: the last stack's connections may linger in TIME_WAIT.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(probe.getsockname()[1])
    raise RuntimeError("no free port for the gateway's HTTP bridge")


async def start_local_server(module: str, log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Start a local helper server (`module` prints "... listening URL"); returns it and its
    base URL."""
    process = subprocess.Popen(
        [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=log_path.open("ab"),
        start_new_session=True,
    )
    assert process.stdout is not None
    line = (await asyncio.to_thread(process.stdout.readline)).decode().strip()
    if "listening" not in line:
        process.kill()
        raise RuntimeError(f"{module} did not start: {line!r}; see {log_path}")
    return process, line.rsplit(" ", 1)[-1]


@dataclass
class Stack:
    """A running stack; `start()` then `stop()`."""

    data_dir: Path
    settings: UpSettings = field(default_factory=UpSettings)
    extra_env: dict[str, str] = field(default_factory=dict)
    services: ServiceSet | None = None
    supervisor: ServiceSupervisor | None = None
    info: dict[str, Any] = field(default_factory=dict)
    _pg: ChildPostgres | None = None
    _redis: EmbeddedRedis | None = None
    _helpers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _slack: SlackStandIn | None = None
    _mcp: McpStandIn | None = None

    async def start(self) -> dict[str, Any]:
        """Bring everything up; returns what is written to stack.json."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        run_dir = self.data_dir / "run"
        run_dir.mkdir(exist_ok=True)
        db_url = self.settings.database_url
        if not db_url:
            self._pg = ChildPostgres(self.data_dir / "postgres")
            server_url = await self._pg.start()
            db_url = await ensure_database(server_url, DATABASE)
        await upgrade(db_url)
        redis_url = self.settings.redis_url
        worker_redis_url = self.settings.worker_redis_url
        if not redis_url:
            worker = worker_redis_user()
            self._redis = EmbeddedRedis(self.data_dir / "redis", users=(worker,))
            redis_url = await self._redis.start()
            worker_redis_url = self._redis.url_of(worker)
        elif not worker_redis_url:
            log.warning(
                "TETHER_UP_WORKER_REDIS_URL is not set: workers get no Redis (the services' "
                "user may do anything), so runs stream no live deltas"
            )
        operator = _read_secret(self.data_dir / "operator_credential", OPERATOR_PREFIX)
        env = {
            "TETHER_DATABASE_URL": db_url,
            "TETHER_REDIS_URL": redis_url,
            "TETHER_GATEWAY_OPERATOR_CREDENTIAL_SHA256": credentials.verifier(operator),
            # processes.meant_for hands it to interactions alone.
            credentials.SECRETS_KEY_ENV: _secrets_key(self.data_dir / "secrets_key"),
            **self.extra_env,
        }
        # The stand-ins and a developer's own receivers listen on loopback; an operator's own
        # choice, in the environment or the stack's, is kept.
        if TARGETS_SETTING not in env and TARGETS_SETTING not in os.environ:
            env[TARGETS_SETTING] = "loopback"
        model_url = ""
        if not os.environ.get("ANTHROPIC_API_KEY"):
            model, model_url = await start_local_server(
                "tether.testing.model_server", run_dir / "model-server.log"
            )
            self._helpers.append(model)
            env["TETHER_WORKER_ANTHROPIC_BASE_URL"] = model_url
            env["TETHER_WORKER_ANTHROPIC_API_KEY"] = "local-model-server"
        # The demo toolkit's OAuth provider, so a connection pause can be tried end to end.
        oauth, oauth_url = await start_local_server("tether.testing.oauth", run_dir / "oauth.log")
        self._helpers.append(oauth)
        env["TETHER_INTERACTIONS_OAUTH_BASE_URL"] = oauth_url
        stack_file = self.data_dir / "stack.json"
        previous = json.loads(stack_file.read_text()) if stack_file.exists() else {}
        if self.settings.demo_slack:
            port = demo_slack.port_for(previous)
            self._slack = SlackStandIn(run_dir / "slack.log", port)
            await self._slack.start()
        if self.settings.demo_mcp:
            self._mcp = McpStandIn(run_dir / "mcp.log", demo_mcp.port_for(previous))
            await self._mcp.start()
        chosen = env.get("TETHER_GATEWAY_HTTP_PORT") or os.environ.get("TETHER_GATEWAY_HTTP_PORT")
        if not chosen or chosen == "0":
            chosen = str(http_port_for(previous))
        env["TETHER_GATEWAY_HTTP_PORT"] = chosen
        # The connection card's login round trip ends back in the console.
        env["TETHER_INTERACTIONS_OAUTH_REDIRECT_URI"] = (
            f"http://127.0.0.1:{env['TETHER_GATEWAY_HTTP_PORT']}/console/connected"
        )
        api_key = await dev_key(db_url, previous)
        self.services = ServiceSet(
            run_dir, env, credentials.generate(), worker_redis_url=worker_redis_url
        )
        await self.services.start_all(replicas={"worker": self.settings.workers})
        addresses = self.services.addresses()
        self.info = {
            "gateway": addresses["gateway"],
            "http": self.services.http_addresses().get("gateway", ""),
            "tenant_id": DEV_TENANT,
            "principal_id": DEV_PRINCIPAL,
            "api_key": api_key,
            "operator_credential": operator,
            "services": addresses,
            "database_url": db_url,
            "redis_url": redis_url,
            "model_base_url": model_url,
            "pid": os.getpid(),
            "pids": {name: p.process.pid for name, p in self.services.procs.items()},
        }
        if self._pg is not None:
            self.info["postgres_pid"] = self._pg.process.pid
        if self._redis is not None:
            self.info["redis_pid"] = self._redis.process.pid
        if self._slack is not None:
            self.info[demo_slack.STACK_KEY] = self._slack.api_url
            self.info["slack_pid"] = self._slack.current().pid
        if self._mcp is not None:
            self.info[demo_mcp.STACK_KEY] = self._mcp.url
            self.info["mcp_pid"] = self._mcp.current().pid
        self._write_info()
        # After start_all, whose workers are ready: an apply may name the tools they announce.
        agents_dir = Path(self.settings.agents_dir) if self.settings.agents_dir else EXAMPLE_AGENTS
        mcp_url = self._mcp.url if self._mcp is not None else None
        await apply_agents(addresses["gateway"], api_key, agents_dir, mcp_url=mcp_url)
        if self._slack is not None:
            webhook = await demo_slack.ensure_demo_channel(
                addresses["gateway"], api_key, self._slack.api_url
            )
            if webhook is not None:
                await self._slack.deliver_to(webhook)
        self.supervisor = ServiceSupervisor(
            self.services,
            backoff=RetryPolicy(
                initial_delay=self.settings.restart_delay_s,
                max_delay=self.settings.restart_max_delay_s,
                jitter=0.0,  # one supervisor per machine: nothing to spread out
            ),
            stable_after_s=self.settings.restart_stable_s,
            on_restart=self._restarted,
        )
        self.supervisor.start()
        if self._pg is not None:
            pg = self._pg
            self.supervisor.supervise("postgres", lambda: pg.process, self._restart_postgres)
        if self._redis is not None:
            redis = self._redis
            self.supervisor.supervise("redis", lambda: redis.process, self._restart_redis)
        if self._slack is not None:
            self.supervisor.supervise("slack", self._slack.current, self._restart_slack)
        if self._mcp is not None:
            self.supervisor.supervise("mcp", self._mcp.current, self._restart_mcp)
        return self.info

    async def _restart_postgres(self) -> None:
        assert self._pg is not None
        await self._pg.start()
        log.info("postgres restarted: pid %d on %s", self._pg.process.pid, self._pg.url)
        self.info["postgres_pid"] = self._pg.process.pid
        self._write_info()

    async def _restart_redis(self) -> None:
        assert self._redis is not None
        await self._redis.start()
        log.info("redis restarted: pid %d on port %d", self._redis.process.pid, self._redis.port)
        self.info["redis_pid"] = self._redis.process.pid
        self._write_info()

    async def _restart_slack(self) -> None:
        slack = self._slack
        assert slack is not None
        await slack.start()
        log.info("slack stand-in restarted: pid %d on %s", slack.current().pid, slack.base_url)
        self.info["slack_pid"] = slack.current().pid
        self._write_info()

    async def _restart_mcp(self) -> None:
        mcp = self._mcp
        assert mcp is not None
        await mcp.start()
        log.info("MCP stand-in restarted: pid %d on %s", mcp.current().pid, mcp.url)
        self.info["mcp_pid"] = mcp.current().pid
        self._write_info()

    def _write_info(self) -> None:
        stack_file = self.data_dir / "stack.json"
        tmp = stack_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.info, indent=2) + "\n")
        tmp.chmod(0o600)
        os.replace(tmp, stack_file)

    def _restarted(self, proc: ServiceProcess) -> None:
        self.info["pids"][proc.name] = proc.process.pid
        self._write_info()

    async def stop(self) -> None:
        """Stop supervising, stop the services in reverse start order, then the helper
        servers, Redis and PostgreSQL."""
        if self.supervisor is not None:
            await self.supervisor.stop()
        if self.services is not None:
            await self.services.stop_all()
        for helper in self._helpers:
            helper.terminate()
            await asyncio.to_thread(helper.wait)
        if self._slack is not None:
            await self._slack.stop()
        if self._mcp is not None:
            await self._mcp.stop()
        if self._redis is not None:
            self._redis.stop()
        if self._pg is not None:
            await asyncio.to_thread(self._pg.stop)


def log_to_stderr() -> None:
    """The stack's own story (a service died, when it restarts) on the terminal."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s tether up: %(message)s"))
    stack_log = logging.getLogger("tether.stack")
    stack_log.addHandler(handler)
    stack_log.setLevel(logging.INFO)


async def run_until_signalled(data_dir: Path) -> None:
    """`tether up`: start, announce readiness, wait for Ctrl-C or SIGTERM, stop cleanly."""
    log_to_stderr()
    stack = Stack(data_dir, UpSettings())
    try:
        info = await stack.start()
        print(f"stack file: {data_dir / 'stack.json'}", flush=True)  # noqa: T201
        print(f"http bridge: http://{info['http']}", flush=True)  # noqa: T201
        print(f"console: http://{info['http']}/console", flush=True)  # noqa: T201
        print(f"dev API key ({DEV_TENANT}/{DEV_PRINCIPAL}): {info['api_key']}", flush=True)  # noqa: T201
        if demo_slack.STACK_KEY in info:
            slack = info[demo_slack.STACK_KEY].removesuffix("/api/")
            print(f"slack stand-in (channel demo-slack): {slack}", flush=True)  # noqa: T201
        if demo_mcp.STACK_KEY in info:
            print(f"MCP stand-in (agent shop): {info[demo_mcp.STACK_KEY]}", flush=True)  # noqa: T201
        print(f"operator credential: {info['operator_credential']}", flush=True)  # noqa: T201
        print(f"tether ready gateway={info['gateway']}", flush=True)  # noqa: T201
        assert stack.supervisor is not None
        await wait_for_signal(stack.supervisor.failed)  # a signal sets it too
        if stack.supervisor.error is not None:
            raise RuntimeError("the supervisor broke; stack stopped") from stack.supervisor.error
    finally:
        await stack.stop()
        print("tether stopped", flush=True)  # noqa: T201
