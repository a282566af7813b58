"""All SQL for schedules (admission's `schedules` table): adding, listing, pausing, resuming and
removing one, and the tickers' claim of the due ones."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import Row, bindparam, delete, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from tether.db.schema import schedules

_KEY = (
    schedules.c.tenant_id == bindparam("k_tenant_id"),
    schedules.c.schedule_id == bindparam("k_schedule_id"),
)


def _key(tenant_id: str, schedule_id: str) -> dict[str, str]:
    return {"k_tenant_id": tenant_id, "k_schedule_id": schedule_id}


async def insert_schedule(conn: AsyncConnection, values: Mapping[str, Any]) -> Row[Any]:
    """Store a new schedule; its row."""
    stmt = insert(schedules).values(**values).returning(*schedules.c)
    return (await conn.execute(stmt)).one()


async def tenant_schedules(conn: AsyncConnection, tenant_id: str) -> list[Row[Any]]:
    """The tenant's schedules, oldest first."""
    stmt = (
        select(schedules)
        .where(schedules.c.tenant_id == tenant_id)
        .order_by(schedules.c.created_at, schedules.c.schedule_id)
    )
    return list(await conn.execute(stmt))


async def find_schedule(conn: AsyncConnection, tenant_id: str, schedule_id: str) -> Row[Any] | None:
    """One of the tenant's schedules; None when it has none of that id."""
    stmt = select(schedules).where(*_KEY)
    params = _key(tenant_id, schedule_id)
    return (await conn.execute(stmt, params)).first()


_PAUSE = (
    update(schedules)
    .where(*_KEY, schedules.c.paused_at.is_(None))
    .values(paused_at=func.now())
    .returning(*schedules.c)
)
_RESUME = (
    update(schedules)
    .where(*_KEY, schedules.c.paused_at.is_not(None))
    .values(paused_at=None, next_fire_at=bindparam("v_next_fire_at"))
    .returning(*schedules.c)
)


async def pause(conn: AsyncConnection, tenant_id: str, schedule_id: str) -> Row[Any] | None:
    """Pause a running schedule; None when it is absent or paused already (nothing changed)."""
    params = _key(tenant_id, schedule_id)
    return (await conn.execute(_PAUSE, params)).first()


async def resume(
    conn: AsyncConnection, tenant_id: str, schedule_id: str, next_fire_at: datetime
) -> Row[Any] | None:
    """Resume a paused schedule from `next_fire_at`; None when it is absent or running already
    (nothing changed)."""
    params = {**_key(tenant_id, schedule_id), "v_next_fire_at": next_fire_at}
    return (await conn.execute(_RESUME, params)).first()


async def remove(conn: AsyncConnection, tenant_id: str, schedule_id: str) -> bool:
    """Remove one of the tenant's schedules; False when it has none of that id."""
    stmt = delete(schedules).where(*_KEY).returning(schedules.c.schedule_id)
    params = _key(tenant_id, schedule_id)
    return (await conn.execute(stmt, params)).first() is not None


_DUE = (
    select(schedules)
    .where(schedules.c.paused_at.is_(None), schedules.c.next_fire_at <= bindparam("now"))
    .order_by(schedules.c.next_fire_at)
    .limit(bindparam("batch"))
    .with_for_update(skip_locked=True)
)


async def lock_due(conn: AsyncConnection, now: datetime, batch: int) -> list[Row[Any]]:
    """Lock up to `batch` running schedules whose next fire time is at or before `now`, the
    earliest first; one another ticker holds is skipped (it is firing it), so two tickers never
    fire one schedule at once. The lock lasts until the caller's transaction ends."""
    return list(await conn.execute(_DUE, {"now": now, "batch": batch}))


_ADVANCE = (
    update(schedules)
    .where(*_KEY)
    .values(
        next_fire_at=bindparam("v_next_fire_at"),
        last_tick_at=func.coalesce(bindparam("v_last_tick_at"), schedules.c.last_tick_at),
        last_run_id=func.coalesce(bindparam("v_last_run_id"), schedules.c.last_run_id),
    )
)


async def advance(
    conn: AsyncConnection,
    tenant_id: str,
    schedule_id: str,
    *,
    next_fire_at: datetime,
    last_tick_at: datetime | None,
    last_run_id: str | None,
) -> None:
    """Move a locked schedule on to its next fire time, with the last tick that admitted a run
    and that run (None: as they were), in the transaction that admitted it."""
    params = {
        **_key(tenant_id, schedule_id),
        "v_next_fire_at": next_fire_at,
        "v_last_tick_at": last_tick_at,
        "v_last_run_id": last_run_id,
    }
    await conn.execute(_ADVANCE, params)


async def delete_tenant_schedules(conn: AsyncConnection, tenant_id: str, batch: int) -> int:
    """Remove up to `batch` of a deleted tenant's schedules; how many."""
    # A CTE runs once: as a subquery of the DELETE, a locking LIMIT may run again per row.
    held = (
        select(schedules.c.schedule_id)
        .where(schedules.c.tenant_id == tenant_id)
        .limit(batch)
        .with_for_update(skip_locked=True)
        .cte("held")
    )
    result = await conn.execute(
        delete(schedules).where(
            schedules.c.tenant_id == tenant_id, schedules.c.schedule_id.in_(select(held))
        )
    )
    return int(result.rowcount or 0)
