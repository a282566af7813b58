"""All SQL of a tenant's named secrets: each statement keyed by (tenant_id, name), so another
tenant's secret is never found."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection

from services.interactions.sealing import Sealed
from tether.db.schema import secrets


async def insert_secret(
    conn: AsyncConnection,
    *,
    tenant_id: str,
    name: str,
    sealed: Sealed,
    last_four: str,
    created_by: str,
) -> Row[Any, Any, Any] | None:
    """Store a new secret; a miss (None) means the tenant already has one by that name."""
    stmt = (
        pg_insert(secrets)
        .values(
            tenant_id=tenant_id,
            name=name,
            ciphertext=sealed.ciphertext,
            nonce=sealed.nonce,
            key_id=sealed.key_id,
            last_four=last_four,
            created_by=created_by,
        )
        .on_conflict_do_nothing(index_elements=["tenant_id", "name"])
        .returning(secrets.c.name, secrets.c.last_four, secrets.c.created_at)
    )
    return (await conn.execute(stmt)).first()


async def list_secrets(conn: AsyncConnection, tenant_id: str) -> Sequence[Row[Any, Any, Any, Any]]:
    """The tenant's secrets by name: what may be shown, never the ciphertext."""
    return (
        await conn.execute(
            select(secrets.c.name, secrets.c.last_four, secrets.c.created_at, secrets.c.created_by)
            .where(secrets.c.tenant_id == tenant_id)
            .order_by(secrets.c.name)
        )
    ).all()


async def sealed_secret(
    conn: AsyncConnection, tenant_id: str, name: str
) -> Row[Any, Any, Any] | None:
    """One secret's sealed value, for the features that use it (never a caller's read)."""
    return (
        await conn.execute(
            select(secrets.c.ciphertext, secrets.c.nonce, secrets.c.key_id).where(
                secrets.c.tenant_id == tenant_id, secrets.c.name == name
            )
        )
    ).first()


async def delete_secret(conn: AsyncConnection, tenant_id: str, name: str) -> bool:
    """Remove a secret; a miss means the tenant has none by that name."""
    result = await conn.execute(
        delete(secrets)
        .where(secrets.c.tenant_id == tenant_id, secrets.c.name == name)
        .returning(secrets.c.name)
    )
    return result.first() is not None
