"""API keys: generation, hashing and the two statements that store them.

The gateway owns the `api_keys` table; the embedded stack's bootstrap uses the same functions to
create the development tenant's first key.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from tether.db.schema import api_keys, tenants
from tether.ids import new_id

KEY_PREFIX = "tk_"

# What a key may do. A key acts on its own principal's runs; runs:all widens what it may see and
# act on to every run of its tenant (other principals' private chats and integration runs).
RUNS_READ = "runs:read"
RUNS_WRITE = "runs:write"
RUNS_ALL = "runs:all"
INTERACTIONS_WRITE = "interactions:write"  # answer questions, complete connections
APPROVALS_DECIDE = "approvals:decide"
ADMIN = "admin"

CLIENT_SCOPES = (RUNS_READ, RUNS_WRITE, INTERACTIONS_WRITE, APPROVALS_DECIDE)
ALL_SCOPES = (*CLIENT_SCOPES, RUNS_ALL, ADMIN)


@dataclass(frozen=True)
class Principal:
    """Who a verified key speaks for."""

    key_id: str
    tenant_id: str
    principal_id: str
    scopes: frozenset[str]


def hash_key(api_key: str) -> bytes:
    """SHA-256 of the key: keys carry 256 random bits, so a slow hash would add nothing."""
    return hashlib.sha256(api_key.encode()).digest()


async def ensure_tenant(conn: AsyncConnection, tenant_id: str) -> None:
    """Create the tenant when it does not exist."""
    await conn.execute(
        pg_insert(tenants).values(tenant_id=tenant_id, name=tenant_id).on_conflict_do_nothing()
    )


async def create_key(
    conn: AsyncConnection, tenant_id: str, principal_id: str, scopes: Sequence[str]
) -> tuple[str, Principal]:
    """Store a new key's hash; returns the secret (shown once) and what it grants."""
    api_key = KEY_PREFIX + secrets.token_urlsafe(32)
    key_id = new_id("key")
    await conn.execute(
        insert(api_keys).values(
            key_id=key_id,
            tenant_id=tenant_id,
            principal_id=principal_id,
            key_hash=hash_key(api_key),
            scopes=list(scopes),
        )
    )
    return api_key, Principal(key_id, tenant_id, principal_id, frozenset(scopes))


async def find_key(conn: AsyncConnection, api_key: str) -> Principal | None:
    """The principal of an unrevoked key, or None."""
    row: Any = (
        await conn.execute(
            select(api_keys).where(
                api_keys.c.key_hash == hash_key(api_key), api_keys.c.revoked_at.is_(None)
            )
        )
    ).first()
    if row is None:
        return None
    return Principal(row.key_id, row.tenant_id, row.principal_id, frozenset(row.scopes))
