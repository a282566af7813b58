"""Leases: the claim (PostgreSQL as the queue), heartbeats, release and the reaper's reads.

The claim takes the oldest claimable run with FOR UPDATE SKIP LOCKED. Claimable means queued
AND its session's head: admission makes a run the head of an idle session, and a finishing
head hands the session to the oldest queued message (`transitions`), so a conversation
runs one message at a time, in order, and the claim is one indexed scan of one table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import BigInteger, Interval, Text, bindparam, func, insert, select, text, update
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection

from services.orchestrator.repositories.transitions import (
    LEASE_UNTIL,
    NEXT_EPOCH,
    STARTED_ONCE,
    Moved,
    apply,
    lease_held,
)
from tether import formats, states
from tether.db.schema import attempts, audit_log, runs, tenants
from tether.domain import RunError, run_started
from tether.states import RunStatus

_CANDIDATES = (
    select(runs.c.run_id, runs.c.session_id, runs.c.tenant_id, runs.c.attempt, runs.c.lease_epoch)
    .where(runs.c.status == RunStatus.QUEUED.value, runs.c.session_head)
    .order_by(runs.c.created_at, runs.c.run_id)
    .limit(bindparam("limit"))
    .with_for_update(skip_locked=True)
)


async def pick_candidate(conn: AsyncConnection) -> Any:
    """Lock the oldest claimable run (a queued session head), skipping those other claimers
    hold; None when there is none."""
    return (await conn.execute(_CANDIDATES, {"limit": 1})).first()


_CLAIMABLE = select(func.count()).select_from(
    select(runs.c.run_id)
    .where(runs.c.status == RunStatus.QUEUED.value, runs.c.session_head)
    .limit(bindparam("limit"))
    .subquery()
)


async def count_claimable(conn: AsyncConnection, limit: int) -> int:
    """How many claimable runs there are, counting at most `limit` (locked ones too)."""
    return int((await conn.execute(_CLAIMABLE, {"limit": limit})).scalar_one())


async def tenant_agent(conn: AsyncConnection, tenant_id: str) -> dict[str, Any]:
    """The tenant's agent overrides."""
    row = (
        await conn.execute(select(tenants.c.agent).where(tenants.c.tenant_id == tenant_id))
    ).first()
    return dict(row.agent) if row is not None else {}


async def lease(
    conn: AsyncConnection,
    candidate: Any,
    *,
    worker_id: str,
    ttl_s: float,
    config: dict[str, Any],
    max_attempts: int,
    routing_ms: float = 0.0,
) -> Moved | None:
    """Move the locked queued run to running under a new lease epoch, with its run.started
    event; records the attempt."""
    run_id = candidate.run_id
    epoch = candidate.lease_epoch + 1
    moved = await apply(
        conn,
        states.CLAIM,
        run_id,
        events=[run_started(candidate.attempt, worker_id, epoch)],
        values={
            "lease_owner": worker_id,
            "lease_epoch": NEXT_EPOCH,
            "lease_expires_at": LEASE_UNTIL,
            "checkpoint_batch": 0,
            "started_at": STARTED_ONCE,
            "next_attempt_at": None,
            "config": config,
            "max_attempts": max_attempts,
            "format": formats.CURRENT,
        },
        params={"lease_ttl": timedelta(seconds=ttl_s)},
    )
    if moved is None:
        return None
    await conn.execute(
        _NEW_ATTEMPT,
        {
            "n_run_id": run_id,
            "n_lease_epoch": moved.row.lease_epoch,
            "n_attempt": moved.row.attempt,
            "n_worker_id": worker_id,
            "n_stages": {"routing_ms": routing_ms},
        },
    )
    return moved


_NEW_ATTEMPT = insert(attempts).values(
    run_id=bindparam("n_run_id"),
    lease_epoch=bindparam("n_lease_epoch"),
    attempt=bindparam("n_attempt"),
    worker_id=bindparam("n_worker_id"),
    stages=bindparam("n_stages", type_=JSONB),
)


_HELD = (
    func.unnest(
        bindparam("h_run_ids", type_=ARRAY(Text)), bindparam("h_epochs", type_=ARRAY(BigInteger))
    )
    .table_valued("run_id", "epoch")
    .render_derived("held", with_types=False)
)
_RENEW = (
    update(runs)
    .where(runs.c.run_id == _HELD.c.run_id, lease_held(_HELD.c.epoch))
    .values(lease_expires_at=func.now() + bindparam("h_ttl", type_=Interval))
    .returning(
        runs.c.run_id,
        runs.c.lease_epoch,
        runs.c.cancel_requested_at.is_not(None).label("cancel_requested"),
    )
)


async def renew(
    conn: AsyncConnection, held: Sequence[tuple[str, int]], ttl_s: float
) -> Sequence[Row[Any]]:
    """Extend every lease of `held` (run id, epoch) that is still current, in one statement:
    the renewed ones (run_id, lease_epoch, cancel_requested). One missing was reaped, released
    or leased again: its holder must stop."""
    if not held:
        return []
    params = {
        "h_run_ids": [run_id for run_id, _ in held],
        "h_epochs": [epoch for _, epoch in held],
        "h_ttl": timedelta(seconds=ttl_s),
    }
    return (await conn.execute(_RENEW, params)).all()


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


_NEXT_RETRY_IN = select(func.extract("epoch", func.min(runs.c.next_attempt_at) - func.now())).where(
    runs.c.status == RunStatus.RETRY_PENDING.value
)


async def next_retry_in(conn: AsyncConnection) -> float | None:
    """Seconds until the earliest retry-pending run is due (negative: overdue), or None."""
    value = (await conn.execute(_NEXT_RETRY_IN)).scalar()
    return None if value is None else float(value)


_END_ATTEMPT = (
    update(attempts)
    .where(
        attempts.c.run_id == bindparam("a_run_id"), attempts.c.lease_epoch == bindparam("a_epoch")
    )
    .values(
        ended_at=func.now(),
        outcome=bindparam("a_outcome"),
        error=bindparam("a_error", type_=JSONB(none_as_null=True)),
        # Stages recorded at claim (routing) keep theirs; the worker's are added.
        stages=func.coalesce(attempts.c.stages, text("'{}'::jsonb")).op("||")(
            bindparam("a_stages", type_=JSONB)
        ),
    )
)


_AUDITED_END_ATTEMPT = (
    insert(audit_log)
    .values(
        tenant_id=bindparam("au_tenant_id"),
        run_id=bindparam("a_run_id"),
        action=bindparam("au_action"),
        detail=bindparam("au_detail", type_=JSONB),
    )
    .add_cte(_END_ATTEMPT.cte("closed"))
)


@dataclass(frozen=True)
class Audit:
    """An audit record written with the attempt's close, in the same statement."""

    tenant_id: str
    action: str
    detail: dict[str, Any]


async def end_attempt(
    conn: AsyncConnection,
    run_id: str,
    epoch: int,
    outcome: str,
    *,
    error: RunError | None = None,
    stages: dict[str, Any] | None = None,
    audit: Audit | None = None,
) -> None:
    """Close the attempt row of a lease epoch, adding `stages` to those recorded at claim, and
    write `audit` with it (one round trip)."""
    params = {
        "a_run_id": run_id,
        "a_epoch": epoch,
        "a_outcome": outcome,
        "a_error": None if error is None else error.to_row(),
        "a_stages": stages or {},
    }
    if audit is None:
        await conn.execute(_END_ATTEMPT, params)
        return
    params |= {
        "au_tenant_id": audit.tenant_id,
        "au_action": audit.action,
        "au_detail": audit.detail,
    }
    await conn.execute(_AUDITED_END_ATTEMPT, params)


def lease_cleared() -> dict[str, Any]:
    """Column values that drop a lease. A cancel request stays: only a run that ends cancelled
    ever leaves running with one (the moves elsewhere yield to it), and it records when."""
    return {"lease_owner": None, "lease_expires_at": None}
