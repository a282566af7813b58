"""Applying every migration to an empty database yields exactly the declared schema."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest_asyncio
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlalchemy.engine import Connection

from tests.conftest import drop_database
from tether.db.engine import create_engine
from tether.db.migrate import alembic_config, upgrade
from tether.db.schema import metadata
from tether.stack.embedded import database_url


@pytest_asyncio.fixture(loop_scope="session")
async def empty_db(pg_server_url: str) -> AsyncIterator[str]:
    import asyncpg

    admin = await asyncpg.connect(pg_server_url)
    await admin.execute('CREATE DATABASE "tether_migration_test"')
    await admin.close()
    yield database_url(pg_server_url, "tether_migration_test")
    await drop_database(pg_server_url, "tether_migration_test")


def _diff(conn: Connection) -> list[Any]:
    context = MigrationContext.configure(conn, opts={"compare_type": True})
    return list(compare_metadata(context, metadata))


async def test_every_migration_applied_yields_the_declared_schema(empty_db: str) -> None:
    await upgrade(empty_db)
    engine = create_engine(empty_db, pool_size=1)
    try:
        async with engine.connect() as conn:
            diff = await conn.run_sync(_diff)
            head = (await conn.execute(text("SELECT version_num FROM alembic_version"))).scalar()
    finally:
        await engine.dispose()
    assert diff == []
    assert head == ScriptDirectory.from_config(alembic_config()).get_current_head()


async def test_migrations_are_idempotent_to_rerun(empty_db: str) -> None:
    await upgrade(empty_db)
    await upgrade(empty_db)  # a restarted stack runs upgrade again; it must be a no-op
