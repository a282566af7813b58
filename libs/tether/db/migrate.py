"""Runs the Alembic migrations programmatically (no alembic.ini needed), and tells whether a
database's schema is at the migrations this release ships."""

from __future__ import annotations

import enum
import functools
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from tether.db.engine import create_engine

if TYPE_CHECKING:
    from alembic.config import Config

MIGRATIONS = Path(__file__).with_name("migrations")


def alembic_config() -> Config:
    """An Alembic config pointing at the packaged migrations. Alembic is imported only here, by
    what migrates: a service's readiness reads the shipped revisions without it (a third of a
    second of every service's start)."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg


def _upgrade(conn: Connection, revision: str) -> None:
    from alembic import command

    cfg = alembic_config()
    cfg.attributes["connection"] = conn
    command.upgrade(cfg, revision)


async def upgrade(url: str, revision: str = "head") -> None:
    """Apply every migration up to `revision` on the database at `url`."""
    engine = create_engine(url, pool_size=1, application="migrate")
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


_REVISION = re.compile(r'^revision = "([^"]+)"$', re.MULTILINE)
_DOWN_REVISION = re.compile(r'^down_revision = (?:None|"([^"]+)")$', re.MULTILINE)


@functools.cache
def shipped_revisions() -> tuple[str, tuple[str, ...]]:
    """This release's head and every revision it ships, newest first, read from the packaged
    scripts' `revision` and `down_revision` lines as Alembic writes them (a test holds this to
    Alembic's own reading)."""
    down: dict[str, str | None] = {}
    for script in (MIGRATIONS / "versions").glob("*.py"):
        source = script.read_text()
        revision, before = _REVISION.search(source), _DOWN_REVISION.search(source)
        if revision is None or before is None:
            raise RuntimeError(f"{script.name} names no revision and the one before it")
        down[revision[1]] = before[1]
    heads = set(down) - set(down.values())
    if len(heads) != 1:
        raise RuntimeError(f"the packaged migrations have no single head: {sorted(heads)}")
    order = [heads.pop()]
    while (previous := down[order[-1]]) is not None:
        order.append(previous)
    if len(order) != len(down):
        raise RuntimeError("the packaged migrations are not one line of revisions")
    return order[0], tuple(order)


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
