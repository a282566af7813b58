"""Runs the Alembic migrations programmatically (no alembic.ini needed)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
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
