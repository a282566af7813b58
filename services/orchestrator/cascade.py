"""Cancels that cascade down a run tree: cancelling a run cancels every run below it, each in the
same transaction as the run it hangs from (one that holds no worker ends at once; a running one
is flagged, and its worker, told at once through Redis or at its next keepalive, ends it), and a
child whose parent ended any other way (failed, reaped) is cancelled by the children's waker.

A child cancelled alone is only that: its parent is resumed once its children have ended, and
reads the cancel as that delegate call's error result."""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncConnection

from services.orchestrator.publisher import Publisher
from services.orchestrator.repositories import children as children_repo
from services.orchestrator.repositories import parts as parts_repo
from services.orchestrator.repositories import runs as runs_repo
from services.orchestrator.repositories.transitions import NOW, Moved, apply
from tether import states
from tether.bus import Bus
from tether.domain import Interruption, Run, cancelled_error, run_cancelled
from tether.hints import cancel_channel, encode_cancel
from tether.states import RunStatus


@dataclass
class Cancelled:
    """What a cascade did, to publish once its transaction commits: the runs it ended (moves)
    and the running ones it flagged for their workers, with the reason each was given."""

    moved: list[Moved] = field(default_factory=list)
    flagged: list[tuple[Run, str]] = field(default_factory=list)

    async def publish(self, publisher: Publisher, bus: Bus | None) -> None:
        for moved in self.moved:
            await publisher.publish(moved.run, moved.events)
            publisher.wake_next(moved)
        if bus is not None:
            for run, reason in self.flagged:
                bus.post(cancel_channel(run.run_id), encode_cancel(reason))


async def cancel_one(
    conn: AsyncConnection, run_id: str, tenant_id: str, reason: str, into: Cancelled
) -> tuple[Moved | None, Run | None]:
    """Cancel one run of `tenant_id`: one holding no worker ends now (its open calls closed),
    a running one is flagged for its worker (None, None: it had ended, or was flagged before)."""
    moved = await apply(
        conn,
        states.CANCEL,
        run_id,
        tenant_id=tenant_id,
        events=[run_cancelled(reason)],
        values={
            "finished_at": NOW,
            "cancel_requested_at": NOW,  # kept on every cancelled run: when it was asked
            "next_wake_at": None,  # a parked timer never wakes it
            "error": cancelled_error(reason).to_row(),
        },
    )
    if moved is not None:
        # A run cancelled while parked leaves the call that paused it open; close it.
        await parts_repo.close_dangling(conn, moved.run, Interruption.RUN_CANCELLED)
        into.moved.append(moved)
        return moved, None
    # Running: the worker holding the lease sees the flag on its next keepalive, or at once
    # through the Redis signal sent after the commit.
    flagged = await runs_repo.flag_cancel(conn, run_id)
    if flagged is not None:
        into.flagged.append((flagged, reason))
    return None, flagged


async def cancel_below(conn: AsyncConnection, run: Run, into: Cancelled) -> None:
    """Cancel every active run below `run` in its tree, in the caller's transaction."""
    reason = f"run {run.run_id}, above it in its tree, was cancelled"
    for below in await children_repo.subtree(conn, run.run_id):
        if not RunStatus(below.status).terminal:
            await cancel_one(conn, below.run_id, below.tenant_id, reason, into)


async def cancel_orphans(conn: AsyncConnection, limit: int, into: Cancelled) -> int:
    """Cancel the active children (and everything below them) of runs that have ended: a parent
    that failed or was reaped leaves no child running."""
    orphans = await children_repo.orphans(conn, limit)
    for orphan in orphans:
        reason = f"its parent run {orphan.tree_parent_run_id} ended {orphan.parent_status}"
        await cancel_one(conn, orphan.run_id, orphan.tenant_id, reason, into)
        for below in await children_repo.subtree(conn, orphan.run_id):
            if not RunStatus(below.status).terminal:
                await cancel_one(conn, below.run_id, below.tenant_id, reason, into)
    return len(orphans)
