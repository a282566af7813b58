"""A PostgreSQL server of its own with its default durability (fsync and synchronous commit on),
for the drills that kill it: the chaos soak (`python -m tests.drill`) and the system tier's
outage drills (the `durable_pg` fixture). A durability claim needs durable storage, and the
suite's shared test server trades crash safety for speed; this is never the server named by
TETHER_DATABASE_URL. No pytest here: the soak runs without it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import asyncpg

from tether.db.migrate import upgrade
from tether.stack.embedded import EmbeddedPostgres, database_url

log = logging.getLogger(__name__)


class DurablePostgres:
    """A fresh embedded PostgreSQL in `data_dir`, killed with an immediate shutdown and started
    again by the drills."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self._server = EmbeddedPostgres(data_dir)
        self.server_url = ""
        self.settings: dict[str, str] = {}

    async def start(self) -> str:
        """Start it and check it is durable; returns the URL of its `postgres` database."""
        self.server_url = await asyncio.to_thread(self._server.start)
        admin = await asyncpg.connect(self.server_url)
        try:
            for name in ("fsync", "synchronous_commit", "full_page_writes"):
                self.settings[name] = str(await admin.fetchval(f"SHOW {name}"))
        finally:
            await admin.close()
        if self.settings["fsync"] != "on" or self.settings["synchronous_commit"] != "on":
            raise RuntimeError(f"a drill needs a durable server; this one has {self.settings}")
        return self.server_url

    async def create_database(self, name: str) -> str:
        """Create database `name` and apply every migration to it; returns its URL."""
        admin = await asyncpg.connect(self.server_url)
        try:
            await admin.execute(f'CREATE DATABASE "{name}"')
        finally:
            await admin.close()
        url = database_url(self.server_url, name)
        await upgrade(url)
        return url

    def _pg_ctl(self, args: Sequence[str]) -> None:
        """pg_ctl as the user pgserver made the data dir for (postgres refuses to run as root);
        a non-zero exit raises CalledProcessError. Through runuser rather than subprocess's
        `user=`: that forks without vfork, and a plain fork of this process (gRPC threads)
        has been seen to die of SIGSEGV before exec."""
        from pgserver._commands import POSTGRES_BIN_PATH

        server: Any = self._server._server
        command = [str(POSTGRES_BIN_PATH / "pg_ctl"), "-D", str(self.data_dir), *args]
        if server.system_user is not None:
            command = ["runuser", "-u", server.system_user, "--", *command]
        # Files, not pipes: the server pg_ctl starts inherits them and would hold a pipe open.
        with tempfile.TemporaryFile() as output:
            done = subprocess.run(command, stdout=output, stderr=output, timeout=60, check=False)
            if done.returncode != 0:
                output.seek(0)
                raise subprocess.CalledProcessError(done.returncode, command, output.read())

    async def kill(self) -> None:
        """Immediate shutdown: no checkpoint, every backend gone; crash recovery on start."""
        await asyncio.to_thread(self._pg_ctl, ["-m", "immediate", "-w", "stop"])

    async def restart(self, *, tries: int = 3) -> None:
        """Start the killed server again on the same socket (what pgserver started it with), so
        every client's URL still works. pg_ctl itself has been seen to die of a signal on a
        loaded machine: try again while the server is not up, a bounded number of times."""
        socket_dir = parse_qs(urlparse(self.server_url).query)["host"][0]
        log_file = self.data_dir / "log"  # where pgserver has it log
        args = ["-w", "-o", '-h ""', "-o", f"-k {socket_dir}", "-l", str(log_file), "start"]
        for attempt in range(1, tries + 1):
            try:
                await asyncio.to_thread(self._pg_ctl, args)
                return
            except subprocess.CalledProcessError:
                if await self.running():
                    return
                if attempt == tries:
                    raise
                log.warning("pg_ctl start failed (try %d of %d); again", attempt, tries)

    async def running(self) -> bool:
        """Whether the server is up (`pg_ctl status`)."""
        try:
            await asyncio.to_thread(self._pg_ctl, ["status"])
        except subprocess.CalledProcessError as exc:
            if exc.returncode == 3:  # "no server running"
                return False
            raise
        return True

    def stop(self) -> None:
        """Stop it for good. pgserver stops only the postmaster it started, which a kill and
        restart replaced: pg_ctl stops the one running (and fails, harmlessly, if none is)."""
        if self.server_url:
            with contextlib.suppress(subprocess.CalledProcessError):
                self._pg_ctl(["-m", "fast", "-w", "stop"])
        self._server.stop()
