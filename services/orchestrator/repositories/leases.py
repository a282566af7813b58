"""Leases: the claim (PostgreSQL as the queue), heartbeats, release and the reaper's reads.

The claim takes the oldest claimable run with FOR UPDATE SKIP LOCKED, where claimable means
queued AND its session is free or already held by this run AND no older queued run of the same
session waits (FIFO within a session). The session row's compare-and-set is the second guard:
two workers can never start two runs of one conversation.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import bindparam, func, insert, select, text, update
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection

from tether import states
from tether.db.schema import attempts, runs, sessions, tenants
from tether.db.transitions import Event, apply
from tether.states import RunStatus

_CANDIDATES = text(
    """
    SELECT r.run_id, r.session_id, r.tenant_id
    FROM runs r
    JOIN sessions s ON s.session_id = r.session_id
    WHERE r.status = 'queued'
      AND (s.active_run_id IS NULL OR s.active_run_id = r.run_id)
      AND (s.active_run_id = r.run_id OR NOT EXISTS (
            SELECT 1 FROM runs o
            WHERE o.session_id = r.session_id AND o.status = 'queued'
              AND (o.created_at, o.run_id) < (r.created_at, r.run_id)))
    ORDER BY r.created_at, r.run_id
    LIMIT :limit
    FOR UPDATE OF r SKIP LOCKED
    """
)

_TAKE_SESSION = (
    update(sessions)
    .where(
        sessions.c.session_id == bindparam("s_id"),
        (sessions.c.active_run_id.is_(None)) | (sessions.c.active_run_id == bindparam("r_id")),
    )
    .values(active_run_id=bindparam("r_id"))
    .returning(sessions.c.session_id)
)


async def pick_candidates(conn: AsyncConnection, limit: int) -> list[Row[Any]]:
    """Lock up to `limit` claimable runs (skipping those other claimers hold)."""
    return list((await conn.execute(_CANDIDATES, {"limit": limit})).all())


async def take_session(conn: AsyncConnection, session_id: str, run_id: str) -> bool:
    """Compare-and-set the session's active run; False when another run holds it."""
    params = {"s_id": session_id, "r_id": run_id}
    return (await conn.execute(_TAKE_SESSION, params)).first() is not None


async def release_session(conn: AsyncConnection, session_id: str, run_id: str) -> None:
    """Free the session if `run_id` holds it (a finished run lets its follow-ups go)."""
    await conn.execute(
        update(sessions)
        .where(sessions.c.session_id == session_id, sessions.c.active_run_id == run_id)
        .values(active_run_id=None)
    )


async def tenant_agent(conn: AsyncConnection, tenant_id: str) -> dict[str, Any]:
    """The tenant's agent overrides."""
    row = (
        await conn.execute(select(tenants.c.agent).where(tenants.c.tenant_id == tenant_id))
    ).first()
    return dict(row.agent) if row is not None else {}


async def lease(
    conn: AsyncConnection,
    run_id: str,
    *,
    worker_id: str,
    ttl_s: float,
    config: dict[str, Any],
    max_attempts: int,
) -> Row[Any] | None:
    """Move the locked queued run to running under a new lease epoch; records the attempt."""
    row = await apply(
        conn,
        states.CLAIM,
        run_id,
        events=[],
        values={
            "lease_owner": worker_id,
            "lease_epoch": runs.c.lease_epoch + 1,
            "lease_expires_at": func.now() + timedelta(seconds=ttl_s),
            "started_at": func.coalesce(runs.c.started_at, func.now()),
            "next_attempt_at": None,
            "config": config,
            "max_attempts": max_attempts,
        },
    )
    if row is None:
        return None
    await conn.execute(
        insert(attempts).values(
            run_id=run_id, lease_epoch=row.lease_epoch, attempt=row.attempt, worker_id=worker_id
        )
    )
    return row


async def heartbeat(
    conn: AsyncConnection, run_id: str, epoch: int, ttl_s: float
) -> Row[Any] | None:
    """Extend a live lease; None when the epoch is stale or the run no longer running."""
    stmt = (
        update(runs)
        .where(
            runs.c.run_id == run_id,
            runs.c.status == RunStatus.RUNNING.value,
            runs.c.lease_epoch == epoch,
        )
        .values(lease_expires_at=func.now() + timedelta(seconds=ttl_s))
        .returning(runs.c.lease_expires_at, runs.c.cancel_requested_at)
    )
    return (await conn.execute(stmt)).first()


async def expired_leases(conn: AsyncConnection, limit: int) -> list[Row[Any]]:
    """Running runs whose lease expired, locked for the reaper."""
    stmt = (
        select(runs)
        .where(runs.c.status == RunStatus.RUNNING.value, runs.c.lease_expires_at < func.now())
        .order_by(runs.c.lease_expires_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    return list((await conn.execute(stmt)).all())


async def due_retries(conn: AsyncConnection, limit: int) -> list[Any]:
    """Retry-pending runs whose backoff has elapsed, locked for the scheduler."""
    stmt = (
        select(runs.c.run_id, runs.c.attempt)
        .where(
            runs.c.status == RunStatus.RETRY_PENDING.value,
            runs.c.next_attempt_at <= func.now(),
        )
        .order_by(runs.c.next_attempt_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    return list((await conn.execute(stmt)).all())


async def end_attempt(
    conn: AsyncConnection,
    run_id: str,
    epoch: int,
    outcome: str,
    *,
    error: dict[str, Any] | None = None,
    stages: dict[str, Any] | None = None,
) -> None:
    """Close the attempt row of a lease epoch."""
    await conn.execute(
        update(attempts)
        .where(attempts.c.run_id == run_id, attempts.c.lease_epoch == epoch)
        .values(ended_at=func.now(), outcome=outcome, error=error, stages=stages)
    )


def lease_cleared() -> dict[str, Any]:
    """Column values that drop a lease."""
    return {"lease_owner": None, "lease_expires_at": None, "cancel_requested_at": None}


def queued_event(attempt: int, reason: str) -> Event:
    """A run.queued event."""
    return Event("run.queued", {"attempt": attempt, "reason": reason})
