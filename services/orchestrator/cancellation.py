"""How a run ends when an accepted cancel wins the race against a worker's move (a completion,
a retry, a release, a park): cancelled under the same lease fence, with its open calls closed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection

from services.orchestrator.repositories import leases as lease_repo
from services.orchestrator.repositories import progress as repo
from tether import states
from tether.db.transitions import NOW, Event, apply

# The error of a run that ended cancelled because a caller asked.
CANCELLED = {"code": "cancelled", "message": "cancelled by caller"}


async def cancel_instead(
    conn: AsyncConnection,
    run_id: str,
    epoch: int,
    *,
    before: Sequence[Event] = (),
    handed_over: list[str] | None = None,
) -> tuple[Row[Any], list[Event]] | None:
    """End cancelled, under the lease, a run whose move yielded to an accepted cancel: open
    calls closed as interrupted, the attempt closed as cancelled; the row and the events
    appended (`before` first). None when the lease is stale instead: the same fence (status
    and epoch, without the cancel guard) refuses this move too."""
    attempt, parts = await repo.attempt_and_parts(conn, run_id)
    closing = repo.close_attempt(
        parts, attempt, regenerated=False, interrupted="the run was cancelled"
    )
    events = [
        *before,
        *closing.events,
        Event("run.cancelled", {"reason": CANCELLED["message"]}),
    ]
    row = await apply(
        conn,
        states.CANCEL_BY_WORKER,
        run_id,
        epoch=epoch,
        events=events,
        handed_over=handed_over,
        values={
            **lease_repo.lease_cleared(),
            "finished_at": NOW,
            "error": CANCELLED,
            "usage": await repo.usage_total(conn, run_id),
        },
    )
    if row is None:
        return None
    await repo.write_closing(conn, run_id, epoch, closing)
    await lease_repo.end_attempt(conn, run_id, epoch, "cancelled", error=CANCELLED)
    return row, events
