"""All SQL of channel connections. A tenant's reads and writes are keyed by (tenant_id,
channel_id), so another tenant's connection is never found; only the verification lookup
(the gateway's, for a provider's webhook) goes by channel_id alone."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection

from services.interactions.sealing import Sealed
from tether.db.schema import channel_connections as cc

# A row of any width: the statements here pick their columns.
ChannelRow = Row[Any, *tuple[Any, ...]]

_SHOWN = (
    cc.c.channel_id,
    cc.c.kind,
    cc.c.name,
    cc.c.agent,
    cc.c.api_base_url,
    cc.c.reply_url,
    cc.c.settings,
    cc.c.secret_hints,
    cc.c.previous_expires_at,
    cc.c.created_by,
    cc.c.created_at,
)


async def insert_channel(
    conn: AsyncConnection,
    *,
    tenant_id: str,
    channel_id: str,
    kind: str,
    name: str,
    agent: str | None,
    api_base_url: str | None,
    reply_url: str | None,
    settings: dict[str, str],
    sealed: Sealed,
    secret_hints: dict[str, str],
    created_by: str,
) -> ChannelRow | None:
    """Store a new connection; a miss (None) means the tenant has one by that name."""
    stmt = (
        pg_insert(cc)
        .values(
            tenant_id=tenant_id,
            channel_id=channel_id,
            kind=kind,
            name=name,
            agent=agent,
            api_base_url=api_base_url,
            reply_url=reply_url,
            settings=settings,
            ciphertext=sealed.ciphertext,
            nonce=sealed.nonce,
            key_id=sealed.key_id,
            secret_hints=secret_hints,
            created_by=created_by,
        )
        .on_conflict_do_nothing(index_elements=["tenant_id", "name"])
        .returning(*_SHOWN)
    )
    return (await conn.execute(stmt)).first()


async def list_channels(conn: AsyncConnection, tenant_id: str) -> Sequence[ChannelRow]:
    """The tenant's connections by name: what may be shown, never a ciphertext."""
    return (
        await conn.execute(select(*_SHOWN).where(cc.c.tenant_id == tenant_id).order_by(cc.c.name))
    ).all()


async def find_channel(conn: AsyncConnection, tenant_id: str, channel_id: str) -> ChannelRow | None:
    """One connection of the tenant, what may be shown; None when absent or another tenant's."""
    return (
        await conn.execute(
            select(*_SHOWN).where(cc.c.tenant_id == tenant_id, cc.c.channel_id == channel_id)
        )
    ).first()


async def delete_channel(conn: AsyncConnection, tenant_id: str, channel_id: str) -> bool:
    """Remove a connection; a miss means the tenant has none by that id."""
    result = await conn.execute(
        delete(cc)
        .where(cc.c.tenant_id == tenant_id, cc.c.channel_id == channel_id)
        .returning(cc.c.channel_id)
    )
    return result.first() is not None


async def sealed_for_rotation(
    conn: AsyncConnection, tenant_id: str, channel_id: str
) -> ChannelRow | None:
    """The connection's sealed secrets, row-locked until the transaction ends so two rotations
    queue rather than each keep a different 'previous'; None when absent or another tenant's."""
    return (
        await conn.execute(
            select(cc.c.kind, cc.c.ciphertext, cc.c.nonce, cc.c.key_id, cc.c.secret_hints)
            .where(cc.c.tenant_id == tenant_id, cc.c.channel_id == channel_id)
            .with_for_update()
        )
    ).first()


async def store_rotation(
    conn: AsyncConnection,
    *,
    tenant_id: str,
    channel_id: str,
    sealed: Sealed,
    secret_hints: dict[str, str],
    previous: Sealed,
    grace: timedelta,
) -> bool:
    """Replace the secrets and keep the previous verification secret until it expires; a miss
    means the connection was removed since it was locked (cannot happen inside the lock)."""
    result = await conn.execute(
        update(cc)
        .where(cc.c.tenant_id == tenant_id, cc.c.channel_id == channel_id)
        .values(
            ciphertext=sealed.ciphertext,
            nonce=sealed.nonce,
            key_id=sealed.key_id,
            secret_hints=secret_hints,
            previous_ciphertext=previous.ciphertext,
            previous_nonce=previous.nonce,
            previous_key_id=previous.key_id,
            # The database's clock, as the lookup judges it by.
            previous_expires_at=func.now() + grace,
        )
        .returning(cc.c.channel_id)
    )
    return result.first() is not None


async def sealed_for_sending(
    conn: AsyncConnection, tenant_id: str, channel_id: str
) -> ChannelRow | None:
    """A connection's kind, targets, settings and sealed secrets, to send an answer through it;
    None when absent or another tenant's."""
    return (
        await conn.execute(
            select(
                cc.c.kind,
                cc.c.api_base_url,
                cc.c.reply_url,
                cc.c.settings,
                cc.c.ciphertext,
                cc.c.nonce,
                cc.c.key_id,
            ).where(cc.c.tenant_id == tenant_id, cc.c.channel_id == channel_id)
        )
    ).first()


async def verification_row(conn: AsyncConnection, channel_id: str) -> ChannelRow | None:
    """A connection's tenant, kind, agent, settings and sealed secrets by id alone, for the
    gateway's webhook verification; the previous secret's columns with the database's clock to
    judge them by."""
    return (
        await conn.execute(
            select(
                cc.c.tenant_id,
                cc.c.kind,
                cc.c.agent,
                cc.c.settings,
                cc.c.ciphertext,
                cc.c.nonce,
                cc.c.key_id,
                cc.c.previous_ciphertext,
                cc.c.previous_nonce,
                cc.c.previous_key_id,
                cc.c.previous_expires_at,
                # The database's clock, so replicas with skewed clocks judge an expiry alike.
                (cc.c.previous_expires_at > func.now()).label("previous_valid"),
            ).where(cc.c.channel_id == channel_id)
        )
    ).first()
