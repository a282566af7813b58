"""All SQL of the interactions service: interactions, grants and connections (and the tenant's
policy); a tenant's secrets are in secrets_repository. Nothing here reads the run aggregate: whose
a run is, its lease and the interaction it is parked on are the orchestrator's to say, over gRPC."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import and_, delete, exists, func, insert, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection

from services.interactions.sealing import Sealed
from tether import formats
from tether.db.schema import (
    channel_connections,
    connections,
    grants,
    in_state,
    interactions,
    secrets,
    tenants,
    webhook_secrets,
)

# The sweeps leave an interaction a newer release stored to that release's replicas.
_READABLE = interactions.c.format <= formats.CURRENT
# Resolved, its resolution not yet taken by the orchestrator (ix_interactions_undelivered).
_RESOLVED = ("answered", "decided", "completed", "expired")


def _readable(row: Row[Any] | None) -> Row[Any] | None:
    """`row`, refused (StoredFormatTooNew) when a newer release stored it: its questions,
    answers and input are never read with a field dropped."""
    if row is not None:
        formats.check(row.format, f"interaction {row.interaction_id}")
    return row


async def insert_interaction(conn: AsyncConnection, **values: Any) -> None:
    """Store a new pending interaction, in the current stored format."""
    await conn.execute(
        insert(interactions).values(status="pending", format=formats.CURRENT, **values)
    )


async def bound_interaction(
    conn: AsyncConnection, run_id: str, interaction_id: str, kind: str, *, lock: bool = False
) -> Row[Any] | None:
    """The pending interaction of `kind` the run is parked on (the orchestrator named it);
    None once it was resolved."""
    stmt = select(interactions).where(
        interactions.c.interaction_id == interaction_id,
        interactions.c.run_id == run_id,
        interactions.c.kind == kind,
        interactions.c.status == "pending",
    )
    if lock:
        stmt = stmt.with_for_update()
    return _readable((await conn.execute(stmt)).first())


async def resolve(
    conn: AsyncConnection, interaction_id: str, status: str, **values: Any
) -> Row[Any] | None:
    """Move a pending interaction to `status`; None when someone resolved it first. Refused
    when a newer release stored it (the caller's transaction then writes nothing)."""
    return _readable(
        (
            await conn.execute(
                update(interactions)
                .where(
                    interactions.c.interaction_id == interaction_id,
                    interactions.c.status == "pending",
                )
                .values(status=status, resolved_at=func.now(), **values)
                .returning(*interactions.c)
            )
        ).first()
    )


async def close_unresolved(
    conn: AsyncConnection, interaction_id: str, status: str, reason: str
) -> None:
    """Close a pending interaction nobody resolved, with why; nothing is left to deliver."""
    await conn.execute(
        update(interactions)
        .where(interactions.c.interaction_id == interaction_id, interactions.c.status == "pending")
        .values(status=status, reason=reason, resolved_at=func.now(), delivered_at=func.now())
    )


async def answered_questions(conn: AsyncConnection, run_id: str) -> Sequence[Row[Any]]:
    """The run's answered questions, oldest first."""
    rows = (
        await conn.execute(
            select(interactions)
            .where(
                interactions.c.run_id == run_id,
                interactions.c.kind == "question",
                interactions.c.status == "answered",
            )
            .order_by(interactions.c.created_at)
        )
    ).all()
    for row in rows:
        _readable(row)
    return rows


async def has_interactions(conn: AsyncConnection, run_id: str) -> bool:
    """Whether anything was ever requested of a person for this run."""
    found = await conn.execute(
        select(interactions.c.interaction_id).where(interactions.c.run_id == run_id).limit(1)
    )
    return found.first() is not None


async def claim_approval(
    conn: AsyncConnection, run_id: str, tool_call_id: str, tool_name: str, epoch: int
) -> Row[Any] | None:
    """Compare-and-set the decided (or expired) approval of this tool call to claimed; None
    when there is none to claim (undecided, claimed already, another tool or another call).
    Only an interaction the run was parked on is ever decided or expired, so an orphan is
    never claimable. Refused when a newer release stored it (the caller's transaction then
    writes nothing)."""
    target = (
        select(interactions.c.interaction_id)
        .where(
            interactions.c.run_id == run_id,
            interactions.c.tool_call_id == tool_call_id,
            interactions.c.kind == "approval",
            interactions.c.tool_name == tool_name,
            interactions.c.status.in_(("decided", "expired")),
        )
        .order_by(interactions.c.created_at.desc())
        .limit(1)
        .scalar_subquery()
    )
    claimed = (
        await conn.execute(
            update(interactions)
            .where(
                interactions.c.interaction_id == target,
                interactions.c.status.in_(("decided", "expired")),
            )
            .values(status="claimed", claimed_at=func.now(), claimed_epoch=epoch)
            .returning(*interactions.c)
        )
    ).first()
    return _readable(claimed)


async def insert_grant(conn: AsyncConnection, **values: Any) -> None:
    """Store a standing grant."""
    await conn.execute(insert(grants).values(**values))


async def find_grant(
    conn: AsyncConnection,
    *,
    tenant_id: str,
    session_id: str,
    principal_id: str | None,
    tool_name: str,
    risk_category: str,
) -> Row[Any] | None:
    """A standing grant covering this call, if any; a principal grant only for the run's
    owner principal (None, an unknown owner, has none)."""
    covering = [
        and_(
            grants.c.scope == "conversation",
            grants.c.session_id == session_id,
            grants.c.tool_name == tool_name,
        ),
        and_(grants.c.scope == "tenant", grants.c.tool_name == tool_name),
        and_(grants.c.scope == "category", grants.c.risk_category == risk_category),
    ]
    if principal_id is not None:  # `== None` would compile to IS NULL
        covering.append(
            and_(
                grants.c.scope == "principal",
                grants.c.principal_id == principal_id,
                grants.c.tool_name == tool_name,
            )
        )
    stmt = select(grants).where(grants.c.tenant_id == tenant_id, or_(*covering)).limit(1)
    return (await conn.execute(stmt)).first()


async def tenant_policy(conn: AsyncConnection, tenant_id: str) -> dict[str, Any]:
    """The tenant's policy JSON."""
    row = (
        await conn.execute(select(tenants.c.policy).where(tenants.c.tenant_id == tenant_id))
    ).first()
    return dict(row.policy) if row is not None else {}


async def interaction_by_state(conn: AsyncConnection, state_hash: bytes) -> Row[Any] | None:
    """The connection interaction an OAuth state was issued for."""
    return _readable(
        (
            await conn.execute(
                select(interactions)
                .where(interactions.c.oauth_state_hash == state_hash)
                .with_for_update()
            )
        ).first()
    )


async def upsert_connection(
    conn: AsyncConnection,
    *,
    tenant_id: str,
    principal_id: str,
    provider: str,
    scopes: Sequence[str],
    token: Sealed,
    expires_at: datetime,
    refresh: Sealed | None = None,
    token_endpoint: str | None = None,
    client_id: str | None = None,
) -> None:
    """Store (or replace) a principal's connection to a provider, its token sealed; the
    plaintext column keeps '' (NOT NULL for the previous release's reads). An MCP server's
    connection also keeps where and as whom to refresh it, and its refresh token sealed."""
    stmt = pg_insert(connections).values(
        oauth_token_endpoint=token_endpoint,
        oauth_client_id=client_id,
        refresh_ciphertext=None if refresh is None else refresh.ciphertext,
        refresh_nonce=None if refresh is None else refresh.nonce,
        refresh_key_id=None if refresh is None else refresh.key_id,
        tenant_id=tenant_id,
        principal_id=principal_id,
        provider=provider,
        scopes=list(scopes),
        access_token="",
        token_ciphertext=token.ciphertext,
        token_nonce=token.nonce,
        token_key_id=token.key_id,
        expires_at=expires_at,
    )
    await conn.execute(
        stmt.on_conflict_do_update(
            index_elements=["tenant_id", "principal_id", "provider"],
            set_={
                "scopes": stmt.excluded.scopes,
                "access_token": stmt.excluded.access_token,
                "token_ciphertext": stmt.excluded.token_ciphertext,
                "token_nonce": stmt.excluded.token_nonce,
                "token_key_id": stmt.excluded.token_key_id,
                "expires_at": stmt.excluded.expires_at,
                "oauth_token_endpoint": stmt.excluded.oauth_token_endpoint,
                "oauth_client_id": stmt.excluded.oauth_client_id,
                "refresh_ciphertext": stmt.excluded.refresh_ciphertext,
                "refresh_nonce": stmt.excluded.refresh_nonce,
                "refresh_key_id": stmt.excluded.refresh_key_id,
            },
        )
    )


async def plaintext_connections(
    conn: AsyncConnection, limit: int
) -> Sequence[Row[Any, Any, Any, Any]]:
    """Connections whose token is still plaintext (stored before 0023, or by the previous
    release during a rollout)."""
    return (
        await conn.execute(
            select(
                connections.c.tenant_id,
                connections.c.principal_id,
                connections.c.provider,
                connections.c.access_token,
            )
            .where(connections.c.access_token != "")
            .limit(limit)
        )
    ).all()


async def seal_connection_token(
    conn: AsyncConnection,
    tenant_id: str,
    principal_id: str,
    provider: str,
    plaintext: str,
    token: Sealed,
) -> bool:
    """Replace a plaintext token by its sealed form; a miss means the row changed since it was
    read (replaced or sealed by another replica), which then holds the newer token."""
    result = await conn.execute(
        update(connections)
        .where(
            connections.c.tenant_id == tenant_id,
            connections.c.principal_id == principal_id,
            connections.c.provider == provider,
            connections.c.access_token == plaintext,
        )
        .values(
            access_token="",
            token_ciphertext=token.ciphertext,
            token_nonce=token.nonce,
            token_key_id=token.key_id,
        )
    )
    return bool(result.rowcount)


async def find_connection(
    conn: AsyncConnection, tenant_id: str, principal_id: str, provider: str
) -> Row[Any] | None:
    """A principal's connection to a provider."""
    return (
        await conn.execute(
            select(connections).where(
                connections.c.tenant_id == tenant_id,
                connections.c.principal_id == principal_id,
                connections.c.provider == provider,
            )
        )
    ).first()


async def expired_pending(conn: AsyncConnection, limit: int) -> Sequence[Row[Any]]:
    """Pending interactions past their expiry, oldest first (each is then resolved by a
    guarded update, so two sweeps never resolve one twice)."""
    return (
        await conn.execute(
            select(interactions)
            .where(
                in_state(interactions.c.status, "pending"),
                interactions.c.expires_at < func.now(),
                _READABLE,
            )
            .order_by(interactions.c.expires_at)
            .limit(limit)
        )
    ).all()


async def undelivered(conn: AsyncConnection, limit: int) -> Sequence[Row[Any]]:
    """Resolutions the orchestrator has not taken yet: a resume that did not reach it (it was
    down); the sweep delivers them, and the guarded resume makes each count once."""
    return (
        await conn.execute(
            select(interactions)
            .where(
                in_state(interactions.c.status, *_RESOLVED),
                interactions.c.delivered_at.is_(None),
                _READABLE,
                interactions.c.resolved_at < func.now() - func.make_interval(0, 0, 0, 0, 0, 0, 1),
            )
            .order_by(interactions.c.resolved_at)
            .limit(limit)
        )
    ).all()


_PENDING = (in_state(interactions.c.status, "pending"), _READABLE)
_UNDELIVERED = (
    in_state(interactions.c.status, *_RESOLVED),
    interactions.c.delivered_at.is_(None),
    _READABLE,
)


def _earliest(moment: Any, *where: Any) -> Any:
    """Seconds from now until the earliest `moment` of the rows `where` picks (negative: past;
    NULL when it picks none): one probe of the partial index that `where` matches."""
    return select(func.extract("epoch", func.min(moment) - func.now())).where(*where)


async def _seconds(conn: AsyncConnection, earliest: Any) -> float | None:
    value = (await conn.execute(earliest)).scalar()
    return None if value is None else float(value)


async def next_expiry_in(conn: AsyncConnection) -> float | None:
    """Seconds until the earliest pending interaction expires (ix_interactions_open_expiry)."""
    return await _seconds(conn, _earliest(interactions.c.expires_at, *_PENDING))


async def next_binding_check_in(conn: AsyncConnection, older_than_s: float) -> float | None:
    """Seconds until the oldest pending interaction whose binding is unconfirmed is
    `older_than_s` old (ix_interactions_unconfirmed)."""
    checked_at = interactions.c.created_at + func.make_interval(0, 0, 0, 0, 0, 0, older_than_s)
    unbound = interactions.c.bound_at.is_(None)
    return await _seconds(conn, _earliest(checked_at, *_PENDING, unbound))


async def next_redelivery_in(conn: AsyncConnection) -> float | None:
    """Seconds until the oldest undelivered resolution is a second old, when `undelivered`
    takes it (ix_interactions_undelivered)."""
    due_at = interactions.c.resolved_at + func.make_interval(0, 0, 0, 0, 0, 0, 1)
    return await _seconds(conn, _earliest(due_at, *_UNDELIVERED))


async def unconfirmed_pending(
    conn: AsyncConnection, older_than_s: float, limit: int
) -> Sequence[Row[Any]]:
    """Pending interactions older than `older_than_s` whose binding was not confirmed yet,
    oldest first."""
    return (
        await conn.execute(
            select(interactions)
            .where(
                in_state(interactions.c.status, "pending"),
                interactions.c.bound_at.is_(None),
                _READABLE,
                interactions.c.created_at
                < func.now() - func.make_interval(0, 0, 0, 0, 0, 0, older_than_s),
            )
            .order_by(interactions.c.created_at)
            .limit(limit)
        )
    ).all()


async def mark_bound(conn: AsyncConnection, interaction_id: str) -> None:
    """The orchestrator named this interaction as the one its run is parked on."""
    await conn.execute(
        update(interactions)
        .where(interactions.c.interaction_id == interaction_id)
        .values(bound_at=func.now())
    )


async def mark_delivered(conn: AsyncConnection, interaction_id: str) -> None:
    """The orchestrator took this resolution (resumed the run, or it had moved on)."""
    await conn.execute(
        update(interactions)
        .where(interactions.c.interaction_id == interaction_id)
        .values(delivered_at=func.now())
    )


async def delete_tenant_rows(conn: AsyncConnection, tenant_id: str, batch: int) -> int:
    """Remove up to `batch` each of a deleted tenant's grants, interactions (those its runs'
    removal left), connections, secrets,
    channel connections and webhook subscriptions' secrets; how many rows in all."""
    removed = 0
    for table, key in (
        (grants, grants.c.grant_id),
        (interactions, interactions.c.interaction_id),
        (connections, connections.c.principal_id),
        (secrets, secrets.c.name),
        (channel_connections, channel_connections.c.channel_id),
        (webhook_secrets, webhook_secrets.c.subscription_id),
    ):
        picked = select(key).where(table.c.tenant_id == tenant_id).limit(batch)
        where = key.in_(picked.with_for_update(skip_locked=True))
        result = await conn.execute(delete(table).where(table.c.tenant_id == tenant_id, where))
        removed += int(result.rowcount or 0)
    return removed


async def tenant_has_rows(conn: AsyncConnection, tenant_id: str) -> bool:
    """Whether any grant, interaction, connection or secret of the tenant is left."""
    left = (
        exists().where(grants.c.tenant_id == tenant_id)
        | exists().where(interactions.c.tenant_id == tenant_id)
        | exists().where(connections.c.tenant_id == tenant_id)
        | exists().where(secrets.c.tenant_id == tenant_id)
        | exists().where(channel_connections.c.tenant_id == tenant_id)
        | exists().where(webhook_secrets.c.tenant_id == tenant_id)
    )
    return bool((await conn.execute(select(left))).scalar())
