"""The deliveries record: a channel run's answer going out, recorded before it is sent.

Every statement here runs in a transaction that first held the run's lease (`progress.hold_lease`
locks the run's row), so a worker whose lease was reaped records nothing.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection

from tether.db.schema import channel_statuses, deliveries
from tether.domain import Delivery, RunError
from tether.domain.deliveries import OPEN


def delivery_of(row: Row[Any]) -> Delivery:
    """The domain record of a row."""
    return Delivery(
        delivery_id=row.delivery_id,
        run_id=row.run_id,
        channel_id=row.channel_id,
        kind=row.kind,
        state=row.state,
        text=row.text,
        provider_message_id=row.provider_message_id or "",
        attempts=row.attempts,
        error=None if row.error is None else RunError.from_row(row.error),
        created_at=row.created_at,
        finished_at=row.finished_at,
    )


async def record_delivery(
    conn: AsyncConnection,
    *,
    tenant_id: str,
    delivery_id: str,
    run_id: str,
    channel_id: str,
    kind: str,
    state: str,
    text: str,
) -> bool:
    """Record a delivery unless one of that id is recorded already; whether this recorded it
    (a miss: an earlier attempt of the run did, and its record stands)."""
    inserted = (
        await conn.execute(
            pg_insert(deliveries)
            .values(
                tenant_id=tenant_id,
                delivery_id=delivery_id,
                run_id=run_id,
                channel_id=channel_id,
                kind=kind,
                state=state,
                text=text,
            )
            .on_conflict_do_nothing()
            .returning(deliveries.c.delivery_id)
        )
    ).first()
    return inserted is not None


async def find_delivery(conn: AsyncConnection, tenant_id: str, delivery_id: str) -> Delivery | None:
    """The delivery of that id, or None."""
    row = (
        await conn.execute(
            select(deliveries).where(
                deliveries.c.tenant_id == tenant_id, deliveries.c.delivery_id == delivery_id
            )
        )
    ).first()
    return None if row is None else delivery_of(row)


async def find_run_delivery(conn: AsyncConnection, tenant_id: str, run_id: str) -> Delivery | None:
    """The run's delivery (a read for callers), or None."""
    row = (
        await conn.execute(
            select(deliveries)
            .where(deliveries.c.tenant_id == tenant_id, deliveries.c.run_id == run_id)
            .order_by(deliveries.c.created_at)
            .limit(1)
        )
    ).first()
    return None if row is None else delivery_of(row)


async def move_delivery(
    conn: AsyncConnection,
    tenant_id: str,
    delivery_id: str,
    *,
    state: str,
    provider_message_id: str,
    error: RunError | None,
    calls: int,
) -> Delivery | None:
    """Move an open delivery to `state` (counting `calls` provider calls); None when it is not
    open any more (an outcome was recorded first: nothing changed)."""
    finished = state not in OPEN
    values: dict[str, Any] = {"state": state, "attempts": deliveries.c.attempts + calls}
    if provider_message_id:
        values["provider_message_id"] = provider_message_id
    if error is not None:
        values["error"] = error.to_row()
    if finished:
        values["finished_at"] = func.now()
    row = (
        await conn.execute(
            update(deliveries)
            .where(
                deliveries.c.tenant_id == tenant_id,
                deliveries.c.delivery_id == delivery_id,
                deliveries.c.state.in_(OPEN),
            )
            .values(**values)
            .returning(*deliveries.c)
        )
    ).first()
    return None if row is None else delivery_of(row)


async def find_status(
    conn: AsyncConnection, tenant_id: str, channel_id: str, callback_data: str
) -> Row[Any, *tuple[Any, ...]] | None:
    """The earliest status callback of the connection reporting on `callback_data`, or None."""
    return (
        await conn.execute(
            select(channel_statuses.c.provider_message_id, channel_statuses.c.status)
            .where(
                channel_statuses.c.tenant_id == tenant_id,
                channel_statuses.c.callback_data == callback_data,
                channel_statuses.c.channel_id == channel_id,
            )
            .order_by(channel_statuses.c.reported_at)
            .limit(1)
        )
    ).first()


async def open_deliveries(conn: AsyncConnection, run_id: str) -> list[Delivery]:
    """The run's deliveries not yet at an outcome. Not locked: a worker's write takes the run's
    row first, then its delivery's, and so does the transition that reads these (its UPDATE of
    the run comes before it closes them); the lease fence decides which of the two moves."""
    rows = await conn.execute(
        select(deliveries).where(deliveries.c.run_id == run_id, deliveries.c.state.in_(OPEN))
    )
    return [delivery_of(r) for r in rows]


async def close_delivery(conn: AsyncConnection, delivery: Delivery) -> None:
    """Record the outcome `delivery` carries, if it is still open (`deliveries.ended_with_run`)."""
    await conn.execute(
        update(deliveries)
        .where(
            deliveries.c.run_id == delivery.run_id,
            deliveries.c.delivery_id == delivery.delivery_id,
            deliveries.c.state.in_(OPEN),
        )
        .values(
            state=delivery.state,
            error=None if delivery.error is None else delivery.error.to_row(),
            finished_at=func.now(),
        )
    )
