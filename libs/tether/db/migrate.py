"""Runs the Alembic migrations programmatically (no alembic.ini needed), and tells whether a
database's schema is at the migrations this release ships."""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from tether.db.engine import create_engine

MIGRATIONS = Path(__file__).with_name("migrations")


def alembic_config() -> Config:
    """An Alembic config pointing at the packaged migrations."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg


def _upgrade(conn: Connection, revision: str) -> None:
    cfg = alembic_config()
    cfg.attributes["connection"] = conn
    command.upgrade(cfg, revision)


async def upgrade(url: str, revision: str = "head") -> None:
    """Apply every migration up to `revision` on the database at `url`."""
    engine = create_engine(url, pool_size=1)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(_upgrade, revision)
    finally:
        await engine.dispose()


class SchemaState(enum.Enum):
    """Where a database's schema stands against the migrations this release ships."""

    CURRENT = "current"
    """At this release's head."""
    BEHIND = "behind"
    """Not migrated, or at a revision before this release's head: its statements may fail."""
    AHEAD = "ahead"
    """At a revision this release does not ship: a newer release migrated it. Migrations are
    expand-then-contract, so this release still runs on it while both are deployed."""


@functools.cache
def shipped_revisions() -> tuple[str, tuple[str, ...]]:
    """This release's head and every revision it ships (read from the packaged scripts)."""
    scripts = ScriptDirectory.from_config(alembic_config())
    head = scripts.get_current_head()
    if head is None:
        raise RuntimeError("the packaged migrations have no single head")
    return head, tuple(rev.revision for rev in scripts.walk_revisions())


def schema_state(applied: Sequence[str]) -> SchemaState:
    """Where a database whose alembic_version holds `applied` stands against this release."""
    head, shipped = shipped_revisions()
    if head in applied:
        return SchemaState.CURRENT
    if any(revision not in shipped for revision in applied):
        return SchemaState.AHEAD
    return SchemaState.BEHIND  # not migrated yet, or at one of this release's earlier revisions


async def applied_revisions(engine: AsyncEngine) -> tuple[str, ...]:
    """The revisions alembic_version records (none for a database never migrated)."""
    async with engine.connect() as conn:
        if await conn.scalar(text("SELECT to_regclass('alembic_version')")) is None:
            return ()
        rows = await conn.execute(text("SELECT version_num FROM alembic_version"))
        return tuple(str(row[0]) for row in rows)
