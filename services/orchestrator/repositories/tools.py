"""The tool catalog: one row per tool name, as the last worker announcing it said. Written by
every replica's Work hellos, read by applies (which names exist) and ListTools."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from sqlalchemy import func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from tether.db.schema import tool_catalog
from tether.domain import CatalogedTool, ToolAnnouncement


async def announce(
    conn: AsyncConnection, worker_id: str, tools: Sequence[ToolAnnouncement]
) -> None:
    """Upsert the worker's tools, each now announced by it; a tool it no longer announces
    stays (another worker, or this one's last release, may still run it)."""
    if not tools:
        return
    stmt = pg_insert(tool_catalog).values(
        [
            {
                "name": t.name,
                "schema_sha256": t.schema_sha256,
                "risk": t.risk,
                "writes_externally": t.writes_externally,
                "announced_by": worker_id,
            }
            for t in sorted(tools, key=lambda t: t.name)  # one lock order across replicas
        ]
    )
    await conn.execute(
        stmt.on_conflict_do_update(
            index_elements=[tool_catalog.c.name],
            set_={
                "schema_sha256": stmt.excluded.schema_sha256,
                "risk": stmt.excluded.risk,
                "writes_externally": stmt.excluded.writes_externally,
                "announced_by": stmt.excluded.announced_by,
                "announced_at": func.now(),
            },
        )
    )


async def listed(conn: AsyncConnection) -> list[CatalogedTool]:
    """Every tool of the catalog, by name."""
    rows = await conn.execute(select(tool_catalog).order_by(tool_catalog.c.name))
    return [
        CatalogedTool(
            ToolAnnouncement(r.name, r.schema_sha256, r.risk, r.writes_externally),
            r.announced_by,
            r.announced_at,
        )
        for r in rows
    ]


async def known(conn: AsyncConnection, names: Collection[str]) -> set[str]:
    """Which of `names` the catalog holds."""
    rows = await conn.execute(
        select(tool_catalog.c.name).where(tool_catalog.c.name.in_(list(names)))
    )
    return {r.name for r in rows}


async def is_empty(conn: AsyncConnection) -> bool:
    """Whether no worker has announced any tool yet."""
    found = await conn.execute(select(tool_catalog.c.name).limit(1))
    return found.first() is None
