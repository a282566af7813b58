"""The SQL of run-event webhooks that callers ask for: a tenant's subscriptions and their delivery
log, every statement keyed by (tenant_id, id), so another tenant's row is never found. The
dispatcher's statements are in `webhook_dispatch`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from tether.db.schema import webhook_deliveries, webhook_subscriptions
from tether.states import RunStatus

_S = webhook_subscriptions
_D = webhook_deliveries
WAITING = tuple(s.value for s in RunStatus if s.waiting)


@dataclass(frozen=True, slots=True)
class Subscription:
    """A subscription as read: never its secret (interactions holds that)."""

    tenant_id: str
    subscription_id: str
    url: str
    events: tuple[str, ...]
    created_by: str
    created_at: datetime
    disabled_at: datetime | None
    failing_since: datetime | None


@dataclass(frozen=True, slots=True)
class Delivery:
    """One event for one subscription."""

    tenant_id: str
    delivery_id: str
    subscription_id: str
    run_id: str
    seq: int
    event_type: str
    status: str
    attempts: int
    next_attempt_at: datetime | None
    last_http_status: int | None
    last_error: str | None
    created_at: datetime
    sent_at: datetime | None


@dataclass(frozen=True, slots=True)
class Claimed:
    """A delivery a replica claimed to send now: its try number fences the outcome it records."""

    delivery: Delivery
    url: str


def subscription_of(row: Any) -> Subscription:
    """A subscription from its row."""
    return Subscription(
        row.tenant_id,
        row.subscription_id,
        row.url,
        tuple(row.events),
        row.created_by,
        row.created_at,
        row.disabled_at,
        row.failing_since,
    )


def delivery_of(row: Any) -> Delivery:
    """A delivery from its row."""
    return Delivery(
        row.tenant_id,
        row.delivery_id,
        row.subscription_id,
        row.run_id,
        row.seq,
        row.event_type,
        row.status,
        row.attempts,
        row.next_attempt_at,
        row.last_http_status,
        row.last_error,
        row.created_at,
        row.sent_at,
    )


_DELIVERY_COLUMNS = [c for c in _D.c if c.name != "first_attempt_at"]


async def insert_subscription(
    conn: AsyncConnection,
    *,
    tenant_id: str,
    subscription_id: str,
    url: str,
    events: Sequence[str],
    created_by: str,
) -> Subscription:
    """Store a new subscription; it records events committed from now on."""
    row = (
        await conn.execute(
            insert(_S)
            .values(
                tenant_id=tenant_id,
                subscription_id=subscription_id,
                url=url,
                events=list(events),
                created_by=created_by,
            )
            .returning(_S)
        )
    ).one()
    return subscription_of(row)


async def list_subscriptions(conn: AsyncConnection, tenant_id: str) -> list[Subscription]:
    """The tenant's subscriptions, oldest first."""
    rows = await conn.execute(
        select(_S)
        .where(_S.c.tenant_id == tenant_id)
        .order_by(_S.c.created_at, _S.c.subscription_id)
    )
    return [subscription_of(r) for r in rows]


async def delete_subscription(conn: AsyncConnection, tenant_id: str, subscription_id: str) -> bool:
    """Remove a subscription and (by cascade) its delivery log; a miss means absent or another
    tenant's."""
    result = await conn.execute(
        delete(_S).where(_S.c.tenant_id == tenant_id, _S.c.subscription_id == subscription_id)
    )
    return bool(result.rowcount)


async def subscription_exists(conn: AsyncConnection, tenant_id: str, subscription_id: str) -> bool:
    """Whether the tenant has the subscription."""
    found = select(_S.c.subscription_id).where(
        _S.c.tenant_id == tenant_id, _S.c.subscription_id == subscription_id
    )
    return (await conn.execute(found)).first() is not None


async def list_deliveries(
    conn: AsyncConnection, tenant_id: str, subscription_id: str, limit: int
) -> list[Delivery]:
    """A subscription's delivery log, newest first."""
    rows = await conn.execute(
        select(*_DELIVERY_COLUMNS)
        .where(_D.c.tenant_id == tenant_id, _D.c.subscription_id == subscription_id)
        .order_by(_D.c.created_at.desc(), _D.c.seq.desc())
        .limit(limit)
    )
    return [delivery_of(r) for r in rows]


async def requeue_delivery(
    conn: AsyncConnection, tenant_id: str, delivery_id: str
) -> Delivery | None:
    """Make a delivery due now, its give-up window started afresh; a miss means absent or
    another tenant's. A delivery pending already is only made due sooner."""
    row = (
        await conn.execute(
            update(_D)
            .where(_D.c.tenant_id == tenant_id, _D.c.delivery_id == delivery_id)
            .values(
                status="pending",
                next_attempt_at=func.now(),
                first_attempt_at=None,
            )
            .returning(*_DELIVERY_COLUMNS)
        )
    ).first()
    return None if row is None else delivery_of(row)


async def delete_tenant_subscriptions(conn: AsyncConnection, tenant_id: str) -> int:
    """Remove a deleted tenant's subscriptions and (by cascade) their delivery logs; how many
    subscriptions."""
    result = await conn.execute(delete(_S).where(_S.c.tenant_id == tenant_id))
    return int(result.rowcount or 0)


async def tenant_has_subscriptions(conn: AsyncConnection, tenant_id: str) -> bool:
    """Whether any subscription of the tenant is left."""
    found = select(_S.c.subscription_id).where(_S.c.tenant_id == tenant_id).limit(1)
    return (await conn.execute(found)).first() is not None
