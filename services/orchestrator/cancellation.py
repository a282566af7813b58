"""How a run ends when an accepted cancel wins the race against a worker's move (a completion,
a retry, a release, a park): cancelled under the same lease fence, with its open calls closed."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.ext.asyncio import AsyncConnection

from services.orchestrator.repositories import leases as lease_repo
from services.orchestrator.repositories import parts as parts_repo
from services.orchestrator.repositories import progress
from services.orchestrator.repositories.transitions import NOW, Moved, apply
from tether import states
from tether.domain import Event, Interruption, cancelled_error, close_attempt, run_cancelled

# The error of a run that ended cancelled because a caller asked (recovery's too).
CANCELLED = cancelled_error()


async def cancel_instead(
    conn: AsyncConnection, run_id: str, epoch: int, *, before: Sequence[Event] = ()
) -> Moved | None:
    """End cancelled, under the lease, a run whose move yielded to an accepted cancel: open
    calls closed as interrupted, the attempt closed as cancelled, the events appended (`before`
    first). None when the lease is stale instead: the same fence (status and epoch, without the
    cancel guard) refuses this move too."""
    attempt, parts = await parts_repo.attempt_and_parts(conn, run_id)
    closing = close_attempt(
        parts, attempt, regenerated=False, interrupted=Interruption.RUN_CANCELLED
    )
    moved = await apply(
        conn,
        states.CANCEL_BY_WORKER,
        run_id,
        epoch=epoch,
        events=[*before, *closing.events, run_cancelled(CANCELLED.message)],
        values={
            **lease_repo.lease_cleared(),
            "finished_at": NOW,
            "error": CANCELLED.to_row(),
            "usage": await progress.usage_total(conn, run_id),
        },
    )
    if moved is None:
        return None
    await parts_repo.write_closing(conn, run_id, epoch, closing)
    await lease_repo.end_attempt(conn, run_id, epoch, "cancelled", error=CANCELLED)
    return moved
