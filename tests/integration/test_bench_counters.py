"""The hot-path bench's counters against real servers: the statement log as PostgreSQL writes
it, and Redis's command counts."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio
import redis.asyncio as redis

from bench.counters import StatementLog, redis_calls
from tether.stack.embedded import EmbeddedPostgres, database_url


@pytest_asyncio.fixture(loop_scope="session")
async def own_server(tmp_path: Path) -> AsyncIterator[tuple[str, Path]]:
    """A PostgreSQL of the test's own (the statement log is server-wide): its URL, its log."""
    server = EmbeddedPostgres(tmp_path / "pg")
    url = await asyncio.to_thread(server.start)
    try:
        yield url, server.data_dir / "log"
    finally:
        server.stop()


async def test_the_statement_log_holds_exactly_the_window_of_one_database(
    own_server: tuple[str, Path],
) -> None:
    url, log_path = own_server
    admin = await asyncpg.connect(url)
    log = StatementLog(admin, log_path, tables={"items"})
    await admin.execute("CREATE DATABASE counted")
    client = await asyncpg.connect(database_url(url, "counted"))
    try:
        await log.enable()
        await client.execute("CREATE TABLE items (id int, note text)")  # before the window
        start = await log.mark("start")
        async with client.transaction():  # BEGIN, INSERT, SELECT, COMMIT: one transaction
            await client.execute("INSERT INTO items VALUES ($1, $2)", 1, "two\nlines")
            await client.fetch("SELECT id\n  FROM items\n WHERE id = $1", 1)
        await client.fetchval("SELECT count(*) FROM items")  # its own transaction
        with pytest.raises(asyncpg.DivisionByZeroError):
            await client.execute("SELECT 1 / 0")  # a third, rolled back, and one ERROR
        await admin.execute("SELECT 'another database, not counted'")
        end = await log.mark("end")
        await client.execute("SELECT 'after the window'")
        statements = log.between("counted", start, end)
    finally:
        await log.disable()
        await client.close()
        await admin.close()

    assert statements.by_kind == {"BEGIN": 1, "INSERT": 1, "SELECT": 3, "COMMIT": 1}
    assert statements.transactions == 3
    assert statements.errors == 1
    assert "SELECT id\n  FROM items\n WHERE id = $1" in statements.texts
    assert statements.by_shape["SELECT: items"] == 2
    assert statements.multi_statement == 0


async def test_redis_calls_counts_each_command_once(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    key = f"test:bench:{uuid.uuid4().hex}"
    try:
        before = await redis_calls(client)
        for i in range(3):
            await client.set(key, i)
        await client.get(key)
        after = await redis_calls(client)
    finally:
        await client.delete(key)
        await client.aclose()
    delta = after - before
    assert delta["set"] == 3
    assert delta["get"] == 1
    assert delta["info"] == 1  # the reading before; the one after counts in the next
