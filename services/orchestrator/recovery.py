"""Recovery: retries and dead workers. A failed attempt is scheduled for retry with backoff (or
fails when its budget is spent), due retries are queued again, and the reaper requeues or fails
runs whose worker stopped heartbeating."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.orchestrator import observed
from services.orchestrator.cancellation import CANCELLED, cancel_instead
from services.orchestrator.publisher import Publisher
from services.orchestrator.repositories import leases as lease_repo
from services.orchestrator.repositories import parts as parts_repo
from services.orchestrator.repositories import progress
from services.orchestrator.repositories import queue as queue_repo
from services.orchestrator.repositories import runs as runs_repo
from services.orchestrator.repositories.transitions import NOW, Moved, apply
from tether import states, telemetry
from tether.db.schema import attempts
from tether.domain import (
    DEFAULT_BACKOFF_INITIAL_S,
    DEFAULT_BACKOFF_MAX_S,
    Interruption,
    Run,
    RunError,
    close_attempt,
    run_cancelled,
    run_failed,
    run_queued,
    run_retry_pending,
)
from tether.domain.rules import REISSUED_CALLS
from tether.errors import StaleLease
from tether.ratelimits import RATE_LIMITED
from tether.retry import RetryPolicy
from tether.states import RunStatus
from tether.telemetry import metrics


class Recovery:
    """Retries and the reaper, on this replica."""

    def __init__(self, engine: AsyncEngine, publisher: Publisher) -> None:
        self._engine = engine
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._publisher = publisher
        # Set when this replica schedules a retry: the retry round runs again at once.
        self.retry_scheduled = asyncio.Event()

    async def schedule_retry(
        self, run_id: str, epoch: int, error: RunError, retry_after_s: float
    ) -> Run:
        """Retry-pending with a backoff (at least the server's retry-after), or failed when the
        attempt budget is spent (the last error preserved); cancelled when a cancel was
        accepted first."""
        async with self._engine.begin() as conn:
            # Read under the lease fence and locked: the policy comes from the run as leased,
            # and the guarded move below is fenced by the same expression.
            run = await runs_repo.leased_run(conn, run_id, epoch, lock=True)
            limits = (await runs_repo.routing_of(conn, run_id)).get("limits", {})
            policy = RetryPolicy(
                max_attempts=int(limits.get("max_attempts", run.max_attempts)),
                initial_delay=float(
                    limits.get("backoff_initial_seconds", DEFAULT_BACKOFF_INITIAL_S)
                ),
                max_delay=float(limits.get("backoff_max_seconds", DEFAULT_BACKOFF_MAX_S)),
            )
            moved: Moved | None
            # A wait for a shared model rate limit spends no attempt, and waits exactly until
            # the bucket refills (no backoff: the orchestrator said when).
            limited = error.code == RATE_LIMITED
            spent = run.attempt - (0 if limited else await _rate_limited_waits(conn, run_id))
            if not limited and spent >= policy.max_attempts:
                moved = await self._fail_exhausted(conn, run, epoch, error)
            else:
                backoff = 0.0 if limited else policy.backoff(spent - 1)
                delay = max(backoff, retry_after_s)
                next_at = datetime.now(UTC) + timedelta(seconds=delay)
                # The next attempt streams the cut-off turn anew; its calls left whole run then.
                closing = close_attempt(
                    await parts_repo.list_parts(conn, run_id),
                    run.attempt,
                    regenerated=True,
                    interrupted=None,
                )
                pending = run_retry_pending(
                    run.attempt,
                    policy.max_attempts,
                    next_at.isoformat().replace("+00:00", "Z"),
                    error,
                )
                moved = await apply(
                    conn,
                    states.SCHEDULE_RETRY,
                    run_id,
                    epoch=epoch,
                    events=[*closing.events, pending],
                    values={
                        **lease_repo.lease_cleared(),
                        "next_attempt_at": next_at,
                        "error": error.to_row(),
                    },
                )
                if moved is None:
                    moved = await cancel_instead(conn, run_id, epoch)
                    if moved is None:
                        raise StaleLease(f"run {run_id} moved before its retry was scheduled")
                else:
                    await parts_repo.write_closing(conn, run_id, epoch, closing)
                    await lease_repo.end_attempt(conn, run_id, epoch, "retry-pending", error=error)
        await self._publisher.publish(moved.run, moved.events)
        if moved.run.status != RunStatus.RETRY_PENDING.value:
            self._publisher.wake_next(moved)
        else:
            self.retry_scheduled.set()
            if telemetry.on:
                observed.moved(moved.run)
                metrics.retry(error.code, moved.run.tenant_id)
        return moved.run

    async def _fail_exhausted(
        self, conn: AsyncConnection, run: Run, epoch: int, error: RunError
    ) -> Moved:
        closing = close_attempt(
            await parts_repo.list_parts(conn, run.run_id),
            run.attempt,
            regenerated=False,
            interrupted=Interruption.MODEL_CALL_FAILED,
        )
        moved = await apply(
            conn,
            states.FAIL,
            run.run_id,
            epoch=epoch,
            events=[*closing.events, run_failed(error)],
            values={
                **lease_repo.lease_cleared(),
                "finished_at": NOW,
                "error": error.to_row(),
                "usage": await progress.usage_total(conn, run.run_id),
            },
        )
        if moved is None:
            cancelled = await cancel_instead(conn, run.run_id, epoch)
            if cancelled is None:
                raise StaleLease(f"run {run.run_id} moved before it could fail")
            return cancelled
        await parts_repo.write_closing(conn, run.run_id, epoch, closing)
        await lease_repo.end_attempt(conn, run.run_id, epoch, "failed", error=error)
        return moved

    async def reap_round(self) -> float | None:
        """Reap what expired; the seconds until the next lease this replica knows of expires
        (None: none is held). A lease granted after this round expires no sooner than a lease
        TTL from now, so sleeping until the earlier of the two misses none."""
        await self.reap_expired()
        async with self._autocommit.connect() as conn:
            return await queue_repo.next_expiry_in(conn)

    async def reap_expired(self, limit: int = 100) -> int:
        """Requeue (attempt + 1) or fail runs whose worker stopped heartbeating."""
        reaped: list[Moved] = []
        async with self._engine.begin() as conn:
            for run in await lease_repo.expired_leases(conn, limit):
                requeue = run.cancel_requested_at is None and run.attempt < run.max_attempts
                closing = close_attempt(
                    await parts_repo.list_parts(conn, run.run_id),
                    run.attempt,
                    regenerated=requeue,
                    interrupted=Interruption.LEASE_LOST,
                    # A requeued run's next attempt issues its delegate calls again and finds
                    # their children.
                    keep=REISSUED_CALLS if requeue else frozenset(),
                )
                error = RunError(
                    "lease_expired",
                    f"worker {run.lease_owner} stopped heartbeating",
                    retryable=True,
                )
                values: dict[str, Any] = {**lease_repo.lease_cleared()}
                if run.cancel_requested_at is not None:
                    # Cancelled while its worker was dying: nobody is left to stop, so the
                    # orchestrator finalises the cancellation itself.
                    error = CANCELLED
                    transition = states.CANCEL_BY_WORKER
                    last = run_cancelled(CANCELLED.message)
                    values |= {"error": error.to_row(), "finished_at": NOW}
                elif requeue:
                    transition = states.REAP_REQUEUE
                    last = run_queued(run.attempt + 1, "lease_expired")
                    values |= {"attempt": run.attempt + 1}
                else:
                    transition = states.REAP_FAIL
                    last = run_failed(error)
                    values |= {"error": error.to_row(), "finished_at": NOW}
                moved = await apply(
                    conn,
                    transition,
                    run.run_id,
                    epoch=run.lease_epoch,
                    events=[*closing.events, last],
                    values=values,
                )
                if moved is not None:
                    await parts_repo.write_closing(conn, run.run_id, run.lease_epoch, closing)
                    await lease_repo.end_attempt(
                        conn, run.run_id, run.lease_epoch, "lease_expired", error=error
                    )
                    reaped.append(moved)
        for moved in reaped:
            await self._publisher.publish(moved.run, moved.events)
            if telemetry.on:
                observed.reaped(moved.run)
        if reaped:
            self._publisher.wake([m.handed_over or m.run.run_id for m in reaped])
        return len(reaped)

    async def retry_round(self) -> float | None:
        """Queue the retries that are due; the seconds until the next one is."""
        await self.queue_due_retries()
        async with self._autocommit.connect() as conn:
            return await queue_repo.next_retry_in(conn)

    async def queue_due_retries(self, limit: int = 100) -> int:
        """Move retry-pending runs whose backoff elapsed back to queued (attempt + 1)."""
        queued: list[Moved] = []
        async with self._engine.begin() as conn:
            for run_id, attempt in await lease_repo.due_retries(conn, limit):
                moved = await apply(
                    conn,
                    states.RETRY_DUE,
                    run_id,
                    events=[run_queued(attempt + 1, "retry")],
                    values={"attempt": attempt + 1, "next_attempt_at": None},
                )
                if moved is not None:
                    queued.append(moved)
        for moved in queued:
            await self._publisher.publish(moved.run, moved.events)
        if queued:
            self._publisher.wake([m.run.run_id for m in queued])
        return len(queued)


async def _rate_limited_waits(conn: AsyncConnection, run_id: str) -> int:
    """How many of the run's attempts ended waiting for a model rate limit (they spend none of
    its attempt budget). Read only when a retry is scheduled, never on the hot path."""
    stmt = select(func.count()).where(
        attempts.c.run_id == run_id, attempts.c.error["code"].astext == RATE_LIMITED
    )
    return int((await conn.execute(stmt)).scalar_one())
