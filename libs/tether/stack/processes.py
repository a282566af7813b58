"""Starts the five services as separate processes talking gRPC on loopback, and stops them."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tether.credentials import SECRETS_KEY_ENV, VERIFIERS_ENV, service_env
from tether.runtime.process import companion_ready_file
from tether.settings import TOOL_PREFIX

# Start order: each service after those it calls.
SERVICES = ("orchestrator", "admission", "interactions", "worker", "gateway")
WAVES = (("orchestrator", "admission"), ("interactions",), ("worker", "gateway"))

# What a worker must never hold: a way into the database (a tool runs in its process), the
# services' Redis user (it has one of its own) and the verifiers of a server it is not.
NOT_FOR_WORKERS = frozenset(
    {"TETHER_DATABASE_URL", "TETHER_REDIS_URL", VERIFIERS_ENV, "DATABASE_URL", "REDIS_URL"}
)


def meant_for(service: str, name: str) -> bool:
    """Whether the setting `name` of the stack's (or its caller's) environment reaches
    `service`'s process: never another service's own (TETHER_<OTHER>_..., addresses aside),
    `tether up`'s, a tool's (the worker's alone), the model key (the worker's alone) or the
    secrets key (interactions' alone: no other service may open a sealed secret); and
    never, to a worker, what `NOT_FOR_WORKERS` and PostgreSQL's client variables name."""
    if name.startswith("TETHER_UP_") or name == "TETHER_WORKERS":
        return False
    if name.startswith(TOOL_PREFIX) or name == "ANTHROPIC_API_KEY":
        return service == "worker"
    if name == SECRETS_KEY_ENV:
        return service == "interactions"
    for other in SERVICES:
        prefix = f"TETHER_{other.upper()}_"
        if other != service and name.startswith(prefix) and not name.endswith("_ADDR"):
            return False
    if service == "worker":
        return name not in NOT_FOR_WORKERS and not name.startswith("PG")
    return True


@dataclass
class ServiceProcess:
    """One running service."""

    name: str
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    http_port: int | None = None
    extra_env: Mapping[str, str] = field(default_factory=dict)
    health_port: int | None = None

    @property
    def address(self) -> str:
        """host:port of its gRPC server."""
        return f"127.0.0.1:{self.port}"

    @property
    def health_address(self) -> str:
        """host:port where it answers gRPC health in plaintext: its health-only port when it
        has one (its gRPC port may be mutual TLS), else its gRPC port."""
        return f"127.0.0.1:{self.health_port or self.port}"

    @property
    def http_address(self) -> str | None:
        """host:port of its HTTP server, for a service that has one (the gateway's bridge)."""
        return f"127.0.0.1:{self.http_port}" if self.http_port else None


@dataclass
class ServiceSet:
    """The running services of one stack, started and stopped together."""

    run_dir: Path
    env: Mapping[str, str]
    # Service name -> its own credential (`tether.credentials.generate()`); each process gets
    # its own and every caller's verifier, never another service's secret.
    credentials: Mapping[str, str] = field(default_factory=dict)
    # The worker's Redis URL, a user that may only publish live deltas ("": none, so its runs
    # stream no deltas). None: the stack's own TETHER_REDIS_URL, for a test's Redis that has
    # no users; `tether up` always names one.
    worker_redis_url: str | None = None
    procs: dict[str, ServiceProcess] = field(default_factory=dict)
    # Service name -> the port it is started on whatever its instance, for a service that one
    # started before it calls (the orchestrator calls interactions, which calls it back).
    reserved_ports: dict[str, int] = field(default_factory=dict)

    def addresses(self) -> dict[str, str]:
        """Service name -> host:port."""
        return {name: p.address for name, p in self.procs.items()}

    def http_addresses(self) -> dict[str, str]:
        """Service name -> host:port of the services that also serve HTTP."""
        return {n: p.http_address for n, p in self.procs.items() if p.http_address is not None}

    async def start_all(
        self,
        names: tuple[str, ...] = SERVICES,
        timeout: float = 60.0,
        *,
        replicas: Mapping[str, int] | None = None,
    ) -> None:
        """Start `names`, each wave once the services it calls serve (a wave starts at once);
        `replicas` says how many processes of a service to start (default one: `worker`,
        then `worker-2`, ...)."""
        counts = replicas or {}
        held = None
        if "interactions" in names and "interactions" not in self.reserved_ports:
            # Held open until interactions starts, so no service of the first wave binds it.
            held = socket.socket()
            held.bind(("127.0.0.1", 0))
            self.reserved_ports["interactions"] = held.getsockname()[1]
        try:
            for wave in WAVES:
                if held is not None and "interactions" in wave:
                    held.close()
                    held = None
                batch = [
                    (name, instance_name(name, n))
                    for name in wave
                    if name in names
                    for n in range(1, counts.get(name, 1) + 1)
                ]
                await asyncio.gather(
                    *(
                        self.start(name, timeout=timeout, instance=instance)
                        for name, instance in batch
                    )
                )
        finally:
            if held is not None:
                held.close()

    def _env_for(self, name: str, extra: Mapping[str, str]) -> dict[str, str]:
        """The process's environment: what of the stack's is `meant_for` it (a worker's Redis
        URL its own), its credential, the running services' addresses and `extra`, which wins
        (e.g. a worker given two orchestrator replicas)."""
        inherited = {**os.environ, **self.env}
        env = {k: v for k, v in inherited.items() if meant_for(name, k)}
        if name == "worker":
            redis_url = self.worker_redis_url
            if redis_url is None:
                redis_url = inherited.get("TETHER_REDIS_URL", "")
            env["TETHER_REDIS_URL"] = redis_url
        credentials = service_env(self.credentials, name)
        if name == "worker":
            credentials.pop(VERIFIERS_ENV)  # it serves no internal call
        env.update(credentials)
        for dep, port in self.reserved_ports.items():
            env[f"TETHER_{dep.upper()}_ADDR"] = f"127.0.0.1:{port}"
        for dep, addr in self.addresses().items():
            env[f"TETHER_{dep.upper()}_ADDR"] = addr
        env[f"TETHER_{name.upper()}_HOST"] = "127.0.0.1"
        return {**env, **extra}

    async def start(
        self,
        name: str,
        *,
        timeout: float = 60.0,
        extra_env: Mapping[str, str] | None = None,
        instance: str | None = None,
        until_ready: bool = True,
    ) -> ServiceProcess:
        """Start one service (a second instance gets a numbered name unless `instance` names
        it) and wait until it is ready for calls (with `until_ready` False, only until it has
        bound its ports: a service waiting for its schema reports NOT_SERVING meanwhile)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if instance is None:
            n = 1
            instance = name
            while instance in self.procs and self.procs[instance].process.poll() is None:
                n += 1
                instance = instance_name(name, n)
        ready = self.run_dir / f"{instance}.port"
        ready.unlink(missing_ok=True)
        companions = {
            name: Path(companion_ready_file(str(ready), name)) for name in ("http", "health")
        }
        for companion in companions.values():
            companion.unlink(missing_ok=True)
        log_path = self.run_dir / f"{instance}.log"
        reserved = {}
        if instance == name and name in self.reserved_ports:
            # Its first instance serves where the services that started before it call it.
            reserved[f"TETHER_{name.upper()}_PORT"] = str(self.reserved_ports[name])
        env = self._env_for(
            name, {"TETHER_READY_FILE": str(ready), **reserved, **(extra_env or {})}
        )
        with log_path.open("ab") as log_file:
            process = subprocess.Popen(
                [sys.executable, "-m", f"services.{name}"],
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C in a terminal reaches the supervisor only
            )
        try:
            port = await _wait_ready(ready, process, log_path, timeout)
            # Written before the main ready file by a service that serves HTTP or a
            # health-only port too.
            http_port, health_port = (
                int(path.read_text()) if path.exists() else None for path in companions.values()
            )
            proc = ServiceProcess(
                instance, process, port, log_path, http_port, dict(extra_env or {}), health_port
            )
            if until_ready:
                await wait_serving(proc.health_address, timeout=timeout)
        except BaseException:
            # Not recorded yet, so no stop would reach it: a start that fails or is cancelled
            # (Ctrl-C during a supervisor's restart) leaves no process behind.
            process.kill()
            process.wait()
            raise
        self.procs[instance] = proc
        return proc

    def kill(self, instance: str) -> None:
        """SIGKILL one service, as a crash would."""
        proc = self.procs[instance]
        proc.process.send_signal(signal.SIGKILL)
        proc.process.wait()

    async def restart(
        self, instance: str, *, timeout: float = 60.0, graceful: bool = False
    ) -> ServiceProcess:
        """Stop `instance` if it still runs (SIGKILL, as a crash; SIGTERM and its drain when
        `graceful`, as a rolling restart), then start it again under the same name, on the
        same ports and with the same extra settings, as a supervisor behind a fixed address
        would (the services that call it keep the address they were given)."""
        old = self.procs[instance]
        if graceful:
            await self.stop(instance)
        elif old.process.poll() is None:
            self.kill(instance)
        name = service_of(instance)
        ports = {f"TETHER_{name.upper()}_PORT": str(old.port)}
        if old.http_port is not None:
            ports[f"TETHER_{name.upper()}_HTTP_PORT"] = str(old.http_port)
        if old.health_port is not None:
            ports[f"TETHER_{name.upper()}_HEALTH_PORT"] = str(old.health_port)
        return await self.start(
            name, timeout=timeout, extra_env={**old.extra_env, **ports}, instance=instance
        )

    async def stop(self, instance: str, *, grace: float = 15.0) -> int:
        """SIGTERM one service and wait for it to exit; returns its exit code."""
        proc = self.procs[instance]
        if proc.process.poll() is None:
            proc.process.send_signal(signal.SIGTERM)
        try:
            return await asyncio.to_thread(proc.process.wait, grace)
        except subprocess.TimeoutExpired:
            proc.process.kill()
            return await asyncio.to_thread(proc.process.wait)

    async def stop_all(self, *, grace: float = 15.0) -> None:
        """Stop every service, in reverse start order."""
        for instance in reversed(list(self.procs)):
            await self.stop(instance, grace=grace)
        self.procs.clear()


def instance_name(service: str, n: int) -> str:
    """The name of the n-th process of `service` (1-based): `worker`, `worker-2`, ..."""
    return service if n == 1 else f"{service}-{n}"


def service_of(instance: str) -> str:
    """The service an instance name belongs to (`worker-2` -> `worker`)."""
    head, _, tail = instance.rpartition("-")
    return head if head and tail.isdigit() else instance


async def _wait_ready(
    ready: Path, process: subprocess.Popen[bytes], log_path: Path, timeout: float
) -> int:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not ready.exists():
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{log_path.stem} exited with {process.returncode}:\n{tail}")
        if loop.time() > deadline:
            process.kill()
            raise TimeoutError(f"{log_path.stem} did not start within {timeout}s")
        await asyncio.sleep(0.02)  # the ready file is written once; nothing to subscribe to
    return int(ready.read_text())


async def wait_serving(address: str, *, timeout: float = 30.0, service: str = "") -> None:
    """Wait until the gRPC health at `address` reports SERVING (a service waiting for its
    schema reports NOT_SERVING first: its changes are watched, not polled)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        watch = stub.Watch(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout, wait_for_ready=True
        )
        try:
            async for response in watch:
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError(f"{address} was not SERVING within {timeout}s") from None
            raise
        finally:
            watch.cancel()
        raise RuntimeError(f"{address} stopped reporting its health")
