"""`tether up`'s PostgreSQL, run as a child process: a killed postmaster is started again on the
same socket (the URL the services hold still works) with what was committed, even when a folder
above its data lost the permissions the server's user needs to reach it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import asyncpg
import psutil
import pytest

from tether.stack.postgres import ChildPostgres
from tether.stack.supervisor import exited

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_a_killed_postmaster_starts_again_on_its_socket_with_its_data(
    tmp_path: Path,
) -> None:
    server = ChildPostgres(tmp_path / "above" / "pg")
    url = await server.start()
    try:
        first = server.process
        assert psutil.Process(first.pid).ppid() == os.getpid(), "the postmaster is our child"
        conn = await asyncpg.connect(url)
        try:
            await conn.execute("CREATE TABLE kept (n int); INSERT INTO kept VALUES (7)")
        finally:
            await conn.close()
        first.send_signal(signal.SIGKILL)
        assert await exited(first) == -signal.SIGKILL
        if os.geteuid() == 0:  # the server runs as another user, who must reach the folder
            (tmp_path / "above").chmod(0o700)
        assert await server.start() == url
        assert server.process.pid != first.pid
        conn = await asyncpg.connect(url)
        try:
            assert await conn.fetchval("SELECT n FROM kept") == 7
        finally:
            await conn.close()
    finally:
        server.stop()
    assert server_gone(tmp_path / "above" / "pg")


def server_gone(data_dir: Path) -> bool:
    """No postmaster left on `data_dir` (its lock file goes at a clean shutdown)."""
    return not (data_dir / "postmaster.pid").exists()
