"""Recovery: retries and dead workers. A failed attempt is scheduled for retry with backoff (or
fails when its budget is spent), due retries are queued again, and the reaper requeues or fails
runs whose worker stopped heartbeating."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.orchestrator.cancellation import cancel_instead
from services.orchestrator.publisher import Publisher
from services.orchestrator.repositories import leases as lease_repo
from services.orchestrator.repositories import progress as repo
from tether import states
from tether.db.schema import runs
from tether.db.transitions import NOW, Event, apply
from tether.domain import camel_keys
from tether.errors import StaleLease
from tether.retry import RetryPolicy
from tether.states import RunStatus

log = logging.getLogger(__name__)


class Recovery:
    """Retries and the reaper, on this replica."""

    def __init__(self, engine: AsyncEngine, publisher: Publisher) -> None:
        self._engine = engine
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._publisher = publisher
        # Set (and replaced) when this replica schedules a retry: the scheduler looks again.
        self._retry_scheduled = asyncio.Event()

    async def schedule_retry(
        self, run_id: str, epoch: int, error: dict[str, Any], retry_after_s: float
    ) -> Row[Any]:
        """Retry-pending with a backoff (at least the server's retry-after), or failed when the
        attempt budget is spent (the last error preserved); cancelled when a cancel was
        accepted first."""
        handed_over: list[str] = []
        async with self._engine.begin() as conn:
            run = (await conn.execute(select(runs).where(runs.c.run_id == run_id))).one()
            if run.status != "running" or run.lease_epoch != epoch:
                raise StaleLease(f"lease epoch {epoch} of run {run_id} is no longer current")
            limits = (run.config or {}).get("limits", {})
            policy = RetryPolicy(
                max_attempts=int(limits.get("max_attempts", run.max_attempts)),
                initial_delay=float(limits.get("backoff_initial_seconds", 0.5)),
                max_delay=float(limits.get("backoff_max_seconds", 8.0)),
            )
            if run.attempt >= policy.max_attempts:
                failed = Event("run.failed", {"error": camel_keys(error)})
                row, published = await self._fail_exhausted(
                    conn, run, epoch, error, failed, handed_over
                )
            else:
                delay = max(policy.backoff(run.attempt - 1), retry_after_s)
                next_at = datetime.now(UTC) + timedelta(seconds=delay)
                pending = Event(
                    "run.retry-pending",
                    {
                        "attempt": run.attempt,
                        "maxAttempts": policy.max_attempts,
                        "nextAttemptAt": next_at.isoformat().replace("+00:00", "Z"),
                        "error": camel_keys(error),
                    },
                )
                # The next attempt streams the cut-off turn anew; its calls left whole run then.
                closing = repo.close_attempt(
                    await repo.list_parts(conn, run_id),
                    run.attempt,
                    regenerated=True,
                    interrupted=None,
                )
                events = [*closing.events, pending]
                moved = await apply(
                    conn,
                    states.SCHEDULE_RETRY,
                    run_id,
                    epoch=epoch,
                    events=events,
                    values={
                        **lease_repo.lease_cleared(),
                        "next_attempt_at": next_at,
                        "error": error,
                    },
                )
                if moved is None:
                    cancelled = await cancel_instead(conn, run_id, epoch, handed_over=handed_over)
                    if cancelled is None:
                        raise StaleLease(f"run {run_id} moved before its retry was scheduled")
                    row, published = cancelled
                else:
                    await repo.write_closing(conn, run_id, epoch, closing)
                    await lease_repo.end_attempt(conn, run_id, epoch, "retry-pending", error=error)
                    row, published = moved, events
        await self._publisher.publish(run_id, row.last_seq - len(published) + 1, published)
        if row.status != RunStatus.RETRY_PENDING.value:
            self._publisher.wake(handed_over or ("",))
        else:
            fired, self._retry_scheduled = self._retry_scheduled, asyncio.Event()
            fired.set()
        return row

    async def _fail_exhausted(
        self,
        conn: AsyncConnection,
        run: Row[Any],
        epoch: int,
        error: dict[str, Any],
        event: Event,
        handed_over: list[str],
    ) -> tuple[Row[Any], list[Event]]:
        closing = repo.close_attempt(
            await repo.list_parts(conn, run.run_id),
            run.attempt,
            regenerated=False,
            interrupted="the model call failed",
        )
        events = [*closing.events, event]
        row = await apply(
            conn,
            states.FAIL,
            run.run_id,
            epoch=epoch,
            events=events,
            handed_over=handed_over,
            values={
                **lease_repo.lease_cleared(),
                "finished_at": NOW,
                "error": error,
                "usage": await repo.usage_total(conn, run.run_id),
            },
        )
        if row is None:
            cancelled = await cancel_instead(conn, run.run_id, epoch, handed_over=handed_over)
            if cancelled is None:
                raise StaleLease(f"run {run.run_id} moved before it could fail")
            return cancelled
        await repo.write_closing(conn, run.run_id, epoch, closing)
        await lease_repo.end_attempt(conn, run.run_id, epoch, "failed", error=error)
        return row, events

    async def reap_expired(self, limit: int = 100) -> int:
        """Requeue (attempt + 1) or fail runs whose worker stopped heartbeating."""
        published: list[tuple[str, int, list[Event]]] = []
        async with self._engine.begin() as conn:
            for run in await lease_repo.expired_leases(conn, limit):
                requeue = run.cancel_requested_at is None and run.attempt < run.max_attempts
                closing = repo.close_attempt(
                    await repo.list_parts(conn, run.run_id),
                    run.attempt,
                    regenerated=requeue,
                    interrupted="the worker lost its lease",
                )
                events = list(closing.events)
                error = {
                    "code": "lease_expired",
                    "retryable": True,
                    "message": f"worker {run.lease_owner} stopped heartbeating",
                }
                values: dict[str, Any] = {
                    **lease_repo.lease_cleared(),
                    "error": error,
                    "finished_at": NOW,
                }
                if run.cancel_requested_at is not None:
                    # Cancelled while its worker was dying: nobody is left to stop, so the
                    # orchestrator finalises the cancellation itself.
                    error = {
                        "code": "cancelled",
                        "message": "cancelled by caller",
                        "retryable": True,
                    }
                    values["error"] = error
                    transition = states.CANCEL_BY_WORKER
                    events.append(Event("run.cancelled", {"reason": "cancelled by caller"}))
                elif requeue:
                    transition = states.REAP_REQUEUE
                    values = {**lease_repo.lease_cleared(), "attempt": run.attempt + 1}
                    events.append(lease_repo.queued_event(run.attempt + 1, "lease_expired"))
                else:
                    transition = states.REAP_FAIL
                    events.append(Event("run.failed", {"error": camel_keys(error)}))
                row = await apply(
                    conn,
                    transition,
                    run.run_id,
                    epoch=run.lease_epoch,
                    events=events,
                    values=values,
                )
                if row is not None:
                    await repo.write_closing(conn, run.run_id, run.lease_epoch, closing)
                    await lease_repo.end_attempt(
                        conn, run.run_id, run.lease_epoch, "lease_expired", error=error
                    )
                    published.append((run.run_id, row.last_seq - len(events) + 1, events))
        for run_id, first, events in published:
            await self._publisher.publish(run_id, first, events)
        if published:
            self._publisher.wake([run_id for run_id, _, _ in published])
        return len(published)

    async def schedule_retries(self, max_wait_s: float) -> None:
        """Queue each retry-pending run when its backoff ends: sleep until the earliest one is
        due, woken early when this replica schedules one; at most `max_wait_s` between looks
        (retries scheduled by another replica, if that one is gone)."""
        while True:
            scheduled = self._retry_scheduled  # taken before looking: a later one still wakes
            wait_s = max_wait_s
            try:
                await self.queue_due_retries()
                async with self._autocommit.connect() as conn:
                    due_in = await lease_repo.next_retry_in(conn)
                if due_in is not None:
                    wait_s = min(max(due_in, 0.0), max_wait_s)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("retry scheduling round failed; looking again in %.1f s", wait_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(scheduled.wait(), wait_s)

    async def queue_due_retries(self, limit: int = 100) -> int:
        """Move retry-pending runs whose backoff elapsed back to queued (attempt + 1)."""
        published: list[tuple[str, int, Event]] = []
        async with self._engine.begin() as conn:
            for run in await lease_repo.due_retries(conn, limit):
                event = lease_repo.queued_event(run.attempt + 1, "retry")
                row = await apply(
                    conn,
                    states.RETRY_DUE,
                    run.run_id,
                    events=[event],
                    values={"attempt": run.attempt + 1, "next_attempt_at": None},
                )
                if row is not None:
                    published.append((run.run_id, row.last_seq, event))
        for run_id, seq, event in published:
            await self._publisher.publish(run_id, seq, [event])
        if published:
            self._publisher.wake([run_id for run_id, _, _ in published])
        return len(published)
