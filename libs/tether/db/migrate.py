"""Runs the Alembic migrations programmatically (no alembic.ini needed)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlalchemy.engine import Connection

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


def head_revision() -> str:
    """The newest migration this release has."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "the packaged migrations have one head"
    return head


def known_revisions() -> set[str]:
    """Every migration this release has."""
    return {s.revision for s in ScriptDirectory.from_config(alembic_config()).walk_revisions()}


async def current_revision(url: str) -> str | None:
    """The migration the database at `url` is at (None: none applied)."""
    engine = create_engine(url, pool_size=1)
    try:
        async with engine.connect() as conn:
            exists = "SELECT to_regclass('alembic_version') IS NOT NULL"
            if not (await conn.execute(text(exists))).scalar():
                return None
            at = (await conn.execute(text("SELECT version_num FROM alembic_version"))).scalar()
            return None if at is None else str(at)
    finally:
        await engine.dispose()
