"""A run's parts: written under the lease of the attempt that produced them, superseded when a
later attempt takes their place, read back as domain parts (`tether.domain.Part`) from whichever
stored format wrote them (`tether.formats`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    Integer,
    bindparam,
    func,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, Insert
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from tether import formats
from tether.db.schema import run_parts, runs
from tether.domain import Closing, Interruption, Part, Run, close_attempt, content_json


def read(row: Any, run_id: str) -> Part:
    """A stored part (a row with run_parts' columns) as a domain part."""
    return formats.read_part(
        index=row.part_index,
        role=row.role,
        kind=row.kind,
        payload=row.payload,
        final=row.final,
        superseded=row.superseded_at is not None,
        format=row.format,
        what=f"part {row.part_index} of run {run_id}",
    )


def stored(part: Part) -> dict[str, Any]:
    """A part's stored columns, in the current format."""
    return {
        "part_index": part.index,
        "role": str(part.role),
        "kind": str(part.kind),
        "payload": content_json(part.content),
        "final": part.final,
        "format": formats.CURRENT,
    }


def rewriting(insert: Insert) -> Insert:
    """`insert` of parts, replacing a part already at its index: a rewritten part keeps the
    attempt that first wrote it, and its superseded mark."""
    return insert.on_conflict_do_update(
        index_elements=["run_id", "part_index"],
        set_={
            "role": insert.excluded.role,
            "kind": insert.excluded.kind,
            "payload": insert.excluded.payload,
            "final": insert.excluded.final,
            "format": insert.excluded.format,
            "updated_at": func.now(),
        },
    )


_UPSERT = rewriting(
    pg_insert(run_parts).values(
        run_id=bindparam("run_id"),
        lease_epoch=bindparam("lease_epoch"),
        part_index=bindparam("part_index"),
        role=bindparam("role"),
        kind=bindparam("kind"),
        payload=bindparam("payload"),
        final=bindparam("final"),
        format=bindparam("format"),
    )
)


async def upsert(conn: AsyncConnection, run_id: str, epoch: int, parts: Sequence[Part]) -> None:
    """Insert or replace parts by index (writes proportional to the new parts only); a new part
    belongs to lease `epoch`'s attempt."""
    if parts:
        rows = [{"run_id": run_id, "lease_epoch": epoch, **stored(p)} for p in parts]
        await conn.execute(_UPSERT, rows)


_SUPERSEDE = (
    update(run_parts)
    .where(
        run_parts.c.run_id == bindparam("s_run_id"),
        run_parts.c.part_index == func.any(bindparam("s_indexes", type_=ARRAY(Integer))),
        run_parts.c.superseded_at.is_(None),
    )
    .values(superseded_at=func.now())
)


async def supersede(conn: AsyncConnection, run_id: str, parts: Sequence[Part]) -> None:
    """Mark `parts` superseded (kept, flagged; a part already marked keeps its time)."""
    if parts:
        params = {"s_run_id": run_id, "s_indexes": [p.index for p in parts]}
        await conn.execute(_SUPERSEDE, params)


async def list_parts(
    conn: AsyncConnection, run_id: str, *, include_superseded: bool = True
) -> list[Part]:
    """The run's parts in order; superseded ones (flagged) unless `include_superseded` is off,
    as every read of the run's transcript asks."""
    stmt = select(run_parts).where(run_parts.c.run_id == run_id)
    if not include_superseded:
        stmt = stmt.where(run_parts.c.superseded_at.is_(None))
    rows = (await conn.execute(stmt.order_by(run_parts.c.part_index))).all()
    return [read(r, run_id) for r in rows]


async def parts_at(conn: AsyncConnection, run_id: str, indexes: Sequence[int]) -> dict[int, Part]:
    """The run's parts at `indexes`, by index (none asked: no query)."""
    if not indexes:
        return {}
    stmt = select(run_parts).where(
        run_parts.c.run_id == run_id, run_parts.c.part_index.in_(list(indexes))
    )
    return {r.part_index: read(r, run_id) for r in await conn.execute(stmt)}


_ATTEMPT_PARTS = (
    select(runs.c.attempt, run_parts)
    .select_from(runs.outerjoin(run_parts, run_parts.c.run_id == runs.c.run_id))
    .where(runs.c.run_id == bindparam("run_id"))
    .order_by(run_parts.c.part_index)
)


async def attempt_and_parts(conn: AsyncConnection, run_id: str) -> tuple[int, list[Part]]:
    """The run's current attempt number and all its parts, in one round trip."""
    rows = (await conn.execute(_ATTEMPT_PARTS, {"run_id": run_id})).all()
    return rows[0].attempt, [read(r, run_id) for r in rows if r.part_index is not None]


async def write_closing(conn: AsyncConnection, run_id: str, epoch: int, closing: Closing) -> None:
    """Store what `tether.domain.close_attempt` settled, under the attempt's lease epoch."""
    await upsert(conn, run_id, epoch, closing.parts)
    await supersede(conn, run_id, closing.superseded)


async def close_dangling(conn: AsyncConnection, run: Run, reason: Interruption) -> None:
    """Settle a finished run's parts under its last lease (their events are not needed: the
    run is over)."""
    parts = await list_parts(conn, run.run_id)
    closing = close_attempt(parts, run.attempt, regenerated=False, interrupted=reason)
    await write_closing(conn, run.run_id, run.lease_epoch, closing)
