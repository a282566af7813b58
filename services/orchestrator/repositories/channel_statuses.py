"""What channel providers report about messages sent through a connection (channel_statuses):
recorded idempotently, one row per message and status, and removed with a deleted tenant."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, exists, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from tether.db.schema import channel_statuses as cs


@dataclass(frozen=True)
class ChannelStatus:
    """One status a provider reported about one message."""

    provider_message_id: str
    status: str
    callback_data: str | None
    errors: Any
    reported_at: datetime


async def record(
    conn: AsyncConnection, tenant_id: str, channel_id: str, statuses: list[ChannelStatus]
) -> int:
    """Store the statuses not stored yet; how many were new."""
    if not statuses:
        return 0
    rows = [
        {
            "tenant_id": tenant_id,
            "channel_id": channel_id,
            "provider_message_id": s.provider_message_id,
            "status": s.status,
            "callback_data": s.callback_data,
            "errors": s.errors,
            "reported_at": s.reported_at,
        }
        for s in statuses
    ]
    result = await conn.execute(
        insert(cs).values(rows).on_conflict_do_nothing().returning(cs.c.provider_message_id)
    )
    return len(result.all())


async def delete_tenant(conn: AsyncConnection, tenant_id: str, limit: int) -> int:
    """Remove up to `limit` of a deleted tenant's statuses."""
    batch = (
        select(cs.c.channel_id, cs.c.provider_message_id, cs.c.status)
        .where(cs.c.tenant_id == tenant_id)
        .limit(limit)
        .subquery()
    )
    result = await conn.execute(
        delete(cs).where(
            cs.c.tenant_id == tenant_id,
            cs.c.channel_id == batch.c.channel_id,
            cs.c.provider_message_id == batch.c.provider_message_id,
            cs.c.status == batch.c.status,
        )
    )
    return int(result.rowcount or 0)


async def tenant_has_statuses(conn: AsyncConnection, tenant_id: str) -> bool:
    """Whether any of the tenant's statuses remain."""
    return bool(await conn.scalar(select(exists().where(cs.c.tenant_id == tenant_id))))
