"""The webhook dispatcher's SQL: recording deliveries for new events, claiming due ones, recording
each try's outcome, disabling a failing endpoint and pruning the log. These statements work across
tenants, one subscription or delivery at a time; their lock order is the subscription's row, then
its deliveries'."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection

from services.orchestrator.repositories import runs as runs_repo
from services.orchestrator.repositories.answers import shown_result_text
from services.orchestrator.repositories.webhooks import (
    WAITING,
    Claimed,
    Delivery,
    Subscription,
    delivery_of,
    subscription_of,
)
from tether.db.schema import run_event_log, runs, webhook_deliveries, webhook_subscriptions
from tether.domain import LoggedEvent

_S = webhook_subscriptions
_D = webhook_deliveries


async def lock_subscriptions_to_scan(conn: AsyncConnection, limit: int) -> list[Subscription]:
    """Enabled subscriptions no other replica is scanning (SKIP LOCKED), held until commit."""
    rows = await conn.execute(
        select(_S)
        .where(_S.c.disabled_at.is_(None))
        .order_by(_S.c.scanned_until)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    return [subscription_of(r) for r in rows]


_FINISHED = """
    SELECT run_id FROM runs
    WHERE tenant_id = :tenant_id AND finished_at >= :scan_from"""
# Through the tenant's keys (run_keys), each run then by its id: the dearer part (about 2 us a
# retained run of the tenant).
_WAITING = """
    UNION
    SELECT k.run_id FROM run_keys k JOIN runs r ON r.run_id = k.run_id
    WHERE k.tenant_id = :tenant_id AND r.status = ANY(CAST(:waiting AS text[]))"""
_RECORD = """
WITH candidate AS ({candidates}
)
INSERT INTO webhook_deliveries (tenant_id, delivery_id, subscription_id, run_id, seq, event_type)
SELECT :tenant_id, 'msg_' || replace(gen_random_uuid()::text, '-', ''), :subscription_id,
       e.run_id, e.seq, e.type
FROM candidate c CROSS JOIN LATERAL (
    -- Each candidate's events by its id (OFFSET 0 keeps the search inside): the log reads a
    -- run's run.queued from its row unless its log holds one (0048), a part of the view that
    -- a plain join would read whole, every run of every tenant.
    SELECT * FROM run_event_log WHERE run_event_log.run_id = c.run_id OFFSET 0
) e
WHERE e.type = ANY(CAST(:events AS text[])) AND e.created_at >= :since
ORDER BY e.run_id, e.seq
ON CONFLICT DO NOTHING
"""
_RECORD_FINISHED = text(_RECORD.format(candidates=_FINISHED))
_RECORD_FINISHED_AND_WAITING = text(_RECORD.format(candidates=_FINISHED + _WAITING))
# The event types a run emits as it parks: only these need a look at the runs waiting now.
WAITING_EVENTS = frozenset({"question.requested", "approval.requested", "connection.requested"})


async def record_new_deliveries(
    conn: AsyncConnection, subscription: Subscription, lookback: timedelta, *, waiting: bool
) -> int:
    """Record a delivery for every event of the subscribed types not recorded yet, in the runs
    that may have new ones: those finished since the last scan (less `lookback`, for
    transactions that committed late) and, with `waiting` when the subscription names a waiting
    event, those waiting now. A run that waited and resumed before a look at the waiting ones
    is found when it finishes, its events still in order. Then mark the scan.

    Reads only runs' indexes by tenant and each candidate's events by key: a tenant without a
    subscription costs nothing, and no write was added to a run's own path."""
    scanned = (
        await conn.execute(
            select(_S.c.scanned_until).where(
                _S.c.tenant_id == subscription.tenant_id,
                _S.c.subscription_id == subscription.subscription_id,
            )
        )
    ).scalar_one()
    waiting = waiting and not WAITING_EVENTS.isdisjoint(subscription.events)
    result = await conn.execute(
        _RECORD_FINISHED_AND_WAITING if waiting else _RECORD_FINISHED,
        {
            "tenant_id": subscription.tenant_id,
            "subscription_id": subscription.subscription_id,
            "scan_from": scanned - lookback,
            **({"waiting": list(WAITING)} if waiting else {}),
            "events": list(subscription.events),
            "since": subscription.created_at,
        },
    )
    await conn.execute(
        update(_S)
        .where(
            _S.c.tenant_id == subscription.tenant_id,
            _S.c.subscription_id == subscription.subscription_id,
        )
        .values(scanned_until=func.now())
    )
    return int(result.rowcount or 0)


_PRUNE_LOG = text(
    """
DELETE FROM webhook_deliveries d
WHERE d.tenant_id = :tenant_id AND d.delivery_id IN (
    SELECT o.delivery_id FROM webhook_deliveries o
    WHERE o.tenant_id = :tenant_id AND o.subscription_id = :subscription_id
      AND o.created_at < now() - CAST(:keep AS interval) AND o.status <> 'pending'
      AND NOT EXISTS (
        SELECT 1 FROM runs r
        WHERE r.run_id = o.run_id
          AND (r.finished_at IS NULL OR r.finished_at >= now() - CAST(:keep AS interval)))
    LIMIT :batch)
"""
)


async def prune_log(
    conn: AsyncConnection, subscription: Subscription, keep: timedelta, batch: int
) -> int:
    """Remove up to `batch` of a subscription's deliveries done (sent or given up) more than
    `keep` ago whose run finished more than `keep` ago (or is gone): a scan never looks at such
    a run again, so no event of it is recorded twice; how many."""
    result = await conn.execute(
        _PRUNE_LOG,
        {
            "tenant_id": subscription.tenant_id,
            "subscription_id": subscription.subscription_id,
            "keep": keep,
            "batch": batch,
        },
    )
    return int(result.rowcount or 0)


_CLAIM = text(
    """
UPDATE webhook_deliveries d
SET attempts = d.attempts + 1,
    next_attempt_at = now() + :lease,
    first_attempt_at = coalesce(d.first_attempt_at, now())
FROM (
    SELECT p.tenant_id, p.delivery_id FROM webhook_deliveries p
    WHERE p.status = 'pending' AND p.next_attempt_at <= now()
      AND NOT EXISTS (
        SELECT 1 FROM webhook_deliveries e
        WHERE e.tenant_id = p.tenant_id AND e.subscription_id = p.subscription_id
          AND e.run_id = p.run_id AND e.seq < p.seq AND e.status = 'pending')
    ORDER BY p.next_attempt_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
) due, webhook_subscriptions s
WHERE d.tenant_id = due.tenant_id AND d.delivery_id = due.delivery_id
  AND s.tenant_id = d.tenant_id AND s.subscription_id = d.subscription_id
RETURNING d.*, s.url
"""
)


async def claim_due(conn: AsyncConnection, limit: int, lease: timedelta) -> list[Claimed]:
    """Claim pending deliveries that are due and whose run has no earlier one pending (a run's
    events go in order), each for `lease`: no other replica takes it meanwhile (SKIP LOCKED,
    then the lease). A claim counts as a try."""
    rows = await conn.execute(_CLAIM, {"limit": limit, "lease": lease})
    return [Claimed(delivery_of(r), r.url) for r in rows]


_EARLIEST_DUE = text(
    """
SELECT p.next_attempt_at FROM webhook_deliveries p
WHERE p.status = 'pending'
  AND NOT EXISTS (
    SELECT 1 FROM webhook_deliveries e
    WHERE e.tenant_id = p.tenant_id AND e.subscription_id = p.subscription_id
      AND e.run_id = p.run_id AND e.seq < p.seq AND e.status = 'pending')
ORDER BY p.next_attempt_at
LIMIT 1
"""
)


async def earliest_due(conn: AsyncConnection) -> datetime | None:
    """When the next claimable delivery is due: the earliest of each run's first pending one,
    since a later one waits for it (None: none pending)."""
    due: datetime | None = (await conn.execute(_EARLIEST_DUE)).scalar_one_or_none()
    return due


async def stored_event(conn: AsyncConnection, run_id: str, seq: int) -> LoggedEvent | None:
    """The event a delivery carries, as its readers take it (`formats.fill`); None
    once retention removed its run."""
    row = (
        await conn.execute(
            select(run_event_log, shown_result_text(runs), runs.c.usage)
            .join(runs, runs.c.run_id == run_event_log.c.run_id)
            .where(
                run_event_log.c.run_id == run_id,
                run_event_log.c.seq == seq,
                run_event_log.c.row_seq >= seq,  # for the index (`run_event_log`)
            )
        )
    ).first()
    if row is None:
        return None
    event = LoggedEvent.from_row(row._mapping)
    [filled] = await runs_repo.filled_events(
        conn, run_id, [event], result_text=row.result_text, usage=row.usage
    )
    return filled


async def _lock_subscription(conn: AsyncConnection, claimed: Delivery) -> None:
    """Take the delivery's subscription row first, as a scan does before it records
    deliveries: one lock order (subscription, then delivery), so the two never deadlock."""
    await conn.execute(
        select(_S.c.subscription_id)
        .where(_S.c.tenant_id == claimed.tenant_id, _S.c.subscription_id == claimed.subscription_id)
        .with_for_update()
    )


def _fenced(claimed: Delivery) -> list[Any]:
    return [
        _D.c.tenant_id == claimed.tenant_id,
        _D.c.delivery_id == claimed.delivery_id,
        _D.c.attempts == claimed.attempts,
        _D.c.status == "pending",
    ]


async def mark_sent(conn: AsyncConnection, claimed: Delivery, http_status: int) -> bool:
    """Record a success and clear its subscription's failing streak; a miss means the delivery
    was redelivered or removed meanwhile (a later try owns it)."""
    await _lock_subscription(conn, claimed)
    result = await conn.execute(
        update(_D)
        .where(*_fenced(claimed))
        .values(
            status="sent",
            sent_at=func.now(),
            next_attempt_at=None,
            last_http_status=http_status,
            last_error=None,
        )
    )
    await conn.execute(
        update(_S)
        .where(_S.c.tenant_id == claimed.tenant_id, _S.c.subscription_id == claimed.subscription_id)
        .values(failing_since=None)
    )
    return bool(result.rowcount)


# Given up once its first try is the window old, unless its endpoint has been failing for less
# than the window: then it is the endpoint that fails, and the delivery waits for the endpoint
# to recover or be disabled (which gives up every pending delivery of it).
_MARK_FAILED = text(
    """
WITH verdict AS (
    SELECT d.tenant_id, d.delivery_id,
           now() - d.first_attempt_at >= :give_up AND NOT EXISTS (
               SELECT 1 FROM webhook_subscriptions s
               WHERE s.tenant_id = d.tenant_id AND s.subscription_id = d.subscription_id
                 AND s.failing_since > now() - CAST(:give_up AS interval)) AS give_up
    FROM webhook_deliveries d
    WHERE d.tenant_id = :tenant_id AND d.delivery_id = :delivery_id
)
UPDATE webhook_deliveries d
SET last_http_status = :http_status,
    last_error = :error,
    status = CASE WHEN v.give_up THEN 'failed' ELSE 'pending' END,
    next_attempt_at = CASE WHEN v.give_up THEN NULL ELSE now() + :retry_in END
FROM verdict v
WHERE d.tenant_id = v.tenant_id AND d.delivery_id = v.delivery_id AND d.attempts = :attempts
  AND d.status = 'pending'
RETURNING d.status
"""
)


async def mark_failed(
    conn: AsyncConnection,
    claimed: Delivery,
    *,
    http_status: int | None,
    error: str,
    retry_in: timedelta,
    give_up_after: timedelta,
) -> str | None:
    """Record a failed try: due again after `retry_in`, or given up ("failed") as `_MARK_FAILED`
    says, and start (or continue) its subscription's failing streak; the status the delivery is
    left in (None: a later try owns it)."""
    await _lock_subscription(conn, claimed)
    row = (
        await conn.execute(
            _MARK_FAILED,
            {
                "http_status": http_status,
                "error": error,
                "give_up": give_up_after,
                "retry_in": retry_in,
                "tenant_id": claimed.tenant_id,
                "delivery_id": claimed.delivery_id,
                "attempts": claimed.attempts,
            },
        )
    ).first()
    await conn.execute(
        update(_S)
        .where(_S.c.tenant_id == claimed.tenant_id, _S.c.subscription_id == claimed.subscription_id)
        .values(failing_since=func.coalesce(_S.c.failing_since, func.now()))
    )
    return None if row is None else str(row.status)


async def postpone(
    conn: AsyncConnection, claimed: Delivery, *, error: str, retry_in: timedelta | None
) -> None:
    """A try that failed on this side, not the endpoint's (its secret could not be opened, its
    event is gone): due again after `retry_in`, or given up when None; the endpoint's failing
    streak is left as it is."""
    values: dict[str, Any] = {"last_error": error}
    if retry_in is None:
        values.update(status="failed", next_attempt_at=None)
    else:
        values.update(next_attempt_at=func.now() + retry_in)
    await conn.execute(update(_D).where(*_fenced(claimed)).values(**values))


async def disable_if_failing(
    conn: AsyncConnection, tenant_id: str, subscription_id: str, window: timedelta
) -> Subscription | None:
    """Disable a subscription failing for `window` and give up its pending deliveries; None
    when it is not (or was disabled already)."""
    row = (
        await conn.execute(
            update(_S)
            .where(
                _S.c.tenant_id == tenant_id,
                _S.c.subscription_id == subscription_id,
                _S.c.disabled_at.is_(None),
                _S.c.failing_since <= func.now() - window,
            )
            .values(disabled_at=func.now())
            .returning(_S)
        )
    ).first()
    if row is None:
        return None
    await conn.execute(
        update(_D)
        .where(
            _D.c.tenant_id == tenant_id,
            _D.c.subscription_id == subscription_id,
            _D.c.status == "pending",
        )
        .values(status="failed", next_attempt_at=None, last_error="the subscription was disabled")
    )
    return subscription_of(row)
