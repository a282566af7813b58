"""API keys: generation, hashing and the statements that store, find and revoke them.

The gateway owns the `api_keys` table; the embedded stack's bootstrap uses the same functions to
create the development tenant's first key. A key of a tenant manages keys of that tenant only;
the platform operator (a credential configured into the gateway, never a key) manages tenants
and keys everywhere.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, exists, func, insert, or_, select, update
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
# Names a run's priority within its tenant at admission (fair leases): given on purpose.
RUNS_PRIORITY = "runs:priority"
INTERACTIONS_WRITE = "interactions:write"  # answer questions, complete connections
APPROVALS_DECIDE = "approvals:decide"
# Creates and revokes keys of the key's own tenant, never with scopes wider than its own.
KEYS_ADMIN = "keys:admin"
# The tenant's knowledge documents, which every run of the tenant retrieves from: given on
# purpose, like runs:all, never by default.
DOCUMENTS_READ = "documents:read"
DOCUMENTS_WRITE = "documents:write"

# The tenant's agents, which decide what every run of the tenant may do: given on purpose.
AGENTS_READ = "agents:read"
AGENTS_WRITE = "agents:write"

# The tenant's secrets (interactions' store), which channels and later features reference: given
# on purpose, never by default. No read returns a value.
SECRETS_READ = "secrets:read"
SECRETS_WRITE = "secrets:write"
# A tenant's channel connections (Slack, WhatsApp, signed webhooks): given on purpose.
CHANNELS_READ = "channels:read"
CHANNELS_WRITE = "channels:write"
# A tenant's run-event webhook subscriptions (events pushed to its endpoints): given on purpose.
WEBHOOKS_READ = "webhooks:read"
WEBHOOKS_WRITE = "webhooks:write"
# A tenant's schedules, whose ticks start runs (and spend) with no one asking: given on purpose.
SCHEDULES_READ = "schedules:read"
SCHEDULES_WRITE = "schedules:write"

CLIENT_SCOPES = (RUNS_READ, RUNS_WRITE, INTERACTIONS_WRITE, APPROVALS_DECIDE)
ALL_SCOPES = (
    *CLIENT_SCOPES,
    RUNS_ALL,
    RUNS_PRIORITY,
    KEYS_ADMIN,
    DOCUMENTS_READ,
    DOCUMENTS_WRITE,
    AGENTS_READ,
    AGENTS_WRITE,
    SECRETS_READ,
    SECRETS_WRITE,
    CHANNELS_READ,
    CHANNELS_WRITE,
    WEBHOOKS_READ,
    WEBHOOKS_WRITE,
    SCHEDULES_READ,
    SCHEDULES_WRITE,
)
OPERATOR_ID = "operator"


@dataclass(frozen=True)
class Principal:
    """Who a verified key speaks for."""

    key_id: str
    tenant_id: str
    principal_id: str
    scopes: frozenset[str]
    expires_at: datetime | None = None

    @property
    def is_operator(self) -> bool:
        """Whether this is the platform operator (no tenant, manages every tenant's keys)."""
        return self.key_id == OPERATOR_ID


# The platform operator, as the gateway sees it once its credential verified.
OPERATOR = Principal(OPERATOR_ID, "", OPERATOR_ID, frozenset())


def operator_in(tenant_id: str) -> Principal:
    """The platform operator acting within one tenant it named: it sees and retries every run
    of that tenant, as a runs:all key of it would."""
    return Principal(
        OPERATOR_ID, tenant_id, OPERATOR_ID, frozenset({RUNS_READ, RUNS_WRITE, RUNS_ALL})
    )


def hash_key(api_key: str) -> bytes:
    """SHA-256 of the key: keys carry 256 random bits, so a slow hash would add nothing."""
    return hashlib.sha256(api_key.encode()).digest()


async def ensure_tenant(conn: AsyncConnection, tenant_id: str) -> None:
    """Create the tenant when it does not exist."""
    await conn.execute(
        pg_insert(tenants).values(tenant_id=tenant_id, name=tenant_id).on_conflict_do_nothing()
    )


async def create_key(
    conn: AsyncConnection,
    tenant_id: str,
    principal_id: str,
    scopes: Sequence[str],
    *,
    expires_at: datetime | None = None,
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
            expires_at=expires_at,
        )
    )
    return api_key, Principal(key_id, tenant_id, principal_id, frozenset(scopes), expires_at)


def _principal(row: Any) -> Principal:
    return Principal(
        row.key_id, row.tenant_id, row.principal_id, frozenset(row.scopes), row.expires_at
    )


async def find_key(conn: AsyncConnection, api_key: str) -> Principal | None:
    """The principal of a key neither revoked nor expired, or None."""
    row: Any = (
        await conn.execute(
            select(api_keys).where(
                api_keys.c.key_hash == hash_key(api_key),
                api_keys.c.revoked_at.is_(None),
                or_(api_keys.c.expires_at.is_(None), api_keys.c.expires_at > func.now()),
            )
        )
    ).first()
    return None if row is None else _principal(row)


async def revoke_key(
    conn: AsyncConnection, key_id: str, tenant_id: str | None
) -> tuple[Principal, bool] | None:
    """Revoke a key (of `tenant_id`, or of any tenant when None): the key and whether this
    call revoked it (False: it was already). None when no such key (in that tenant)."""
    scope = [api_keys.c.key_id == key_id]
    if tenant_id is not None:
        scope.append(api_keys.c.tenant_id == tenant_id)
    # A miss means absent, another tenant's, or revoked already; the read below tells which.
    revoked: Any = (
        await conn.execute(
            update(api_keys)
            .where(*scope, api_keys.c.revoked_at.is_(None))
            .values(revoked_at=func.now())
            .returning(api_keys)
        )
    ).first()
    if revoked is not None:
        return _principal(revoked), True
    row: Any = (await conn.execute(select(api_keys).where(*scope))).first()
    return None if row is None else (_principal(row), False)


async def tenant_exists(conn: AsyncConnection, tenant_id: str) -> bool:
    """Whether the tenant exists."""
    found = select(exists().where(tenants.c.tenant_id == tenant_id))
    return bool((await conn.execute(found)).scalar())


async def revoke_tenant_keys(conn: AsyncConnection, tenant_id: str) -> float | None:
    """Revoke every key of the tenant still working (a tenant being deleted); the seconds
    since the last of its keys was revoked, by the database's clock (None: it has none)."""
    await conn.execute(
        update(api_keys)
        .where(api_keys.c.tenant_id == tenant_id, api_keys.c.revoked_at.is_(None))
        .values(revoked_at=func.now())
    )
    since = func.extract("epoch", func.now() - func.max(api_keys.c.revoked_at))
    last = select(since).where(api_keys.c.tenant_id == tenant_id)
    value = (await conn.execute(last)).scalar()
    return None if value is None else float(value)


async def delete_tenant(conn: AsyncConnection, tenant_id: str) -> int:
    """Remove the tenant and its keys (every other service's rows of it went first); how many
    keys were removed."""
    keys = await conn.execute(delete(api_keys).where(api_keys.c.tenant_id == tenant_id))
    await conn.execute(delete(tenants).where(tenants.c.tenant_id == tenant_id))
    return int(keys.rowcount or 0)
