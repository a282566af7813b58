"""The queue as upkeep reads it: its gauges (depth, oldest wait) and when the next lease
expiry or retry falls due, each one scan of a partial index by state."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from tether.db.schema import in_state, runs
from tether.states import RunStatus

_QUEUE = select(
    func.count(),
    func.coalesce(func.extract("epoch", func.now() - func.min(runs.c.updated_at)), 0),
).where(in_state(runs.c.status, RunStatus.QUEUED))


async def queue_stats(conn: AsyncConnection) -> tuple[int, float]:
    """How many runs are queued, and how many seconds the one queued longest has waited (0
    when none is): one scan of the queued runs (the partial ix_runs_session_queued), for the
    queue gauges, once per metric export."""
    depth, oldest_s = (await conn.execute(_QUEUE)).one()
    return int(depth), float(oldest_s)


_NEXT_EXPIRY_IN = select(
    func.extract("epoch", func.min(runs.c.lease_expires_at) - func.now())
).where(in_state(runs.c.status, RunStatus.RUNNING))


async def next_expiry_in(conn: AsyncConnection) -> float | None:
    """Seconds until the earliest running lease expires (negative: expired), or None when no
    run is leased (one scan of the running runs, ix_runs_running: expiries are not indexed, so
    that renewing a lease adds no index entry)."""
    value = (await conn.execute(_NEXT_EXPIRY_IN)).scalar()
    return None if value is None else float(value)


_NEXT_RETRY_IN = select(func.extract("epoch", func.min(runs.c.next_attempt_at) - func.now())).where(
    in_state(runs.c.status, RunStatus.RETRY_PENDING)
)


async def next_retry_in(conn: AsyncConnection) -> float | None:
    """Seconds until the earliest retry-pending run is due (negative: overdue), or None."""
    value = (await conn.execute(_NEXT_RETRY_IN)).scalar()
    return None if value is None else float(value)


_NEXT_WAKE_IN = select(func.extract("epoch", func.min(runs.c.next_wake_at) - func.now())).where(
    in_state(runs.c.status, RunStatus.WAITING_FOR_TIMER)
)


async def next_wake_in(conn: AsyncConnection) -> float | None:
    """Seconds until the earliest parked timer is due (negative: overdue), or None
    (ix_runs_timer_due)."""
    value = (await conn.execute(_NEXT_WAKE_IN)).scalar()
    return None if value is None else float(value)
