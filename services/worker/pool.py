"""The worker pool: claims runs (long-poll), runs attempts with bounded concurrency, keeps their
leases alive, delivers cancel signals, and shuts down gracefully.

Cancellation reaches an attempt within a heartbeat: the heartbeat and checkpoint responses carry
the durable cancel request. A cancel hint on Redis only makes the pool ask at once (a heartbeat
out of turn); the hint itself never stops anything, so a forged or stale one is harmless.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from services.worker.assignment import Assignment
from services.worker.attempt import Attempt
from services.worker.orchestrator_client import Orchestrator
from tether.bus import Bus
from tether.domain import Failed, RunError
from tether.errors import StaleLease, TetherError, Unavailable
from tether.hints import CANCEL_PATTERN, run_of_cancel_channel
from tether.runtime.subscription import Subscription

log = logging.getLogger(__name__)


class WorkerPool:
    """Claims and runs attempts until stopped."""

    def __init__(
        self,
        *,
        worker_id: str,
        orchestrator: Orchestrator,
        make_attempt: Callable[[Assignment], Attempt],
        bus: Bus | None,
        concurrency: int,
        heartbeat_interval_s: float,
        claim_wait_ms: int,
    ) -> None:
        self._worker_id = worker_id
        self._orchestrator = orchestrator
        self._make_attempt = make_attempt
        self._bus = bus
        self._slots = asyncio.Semaphore(concurrency)
        self._heartbeat_interval = heartbeat_interval_s
        self._claim_wait_ms = claim_wait_ms
        self._running: dict[str, tuple[Attempt, asyncio.Task[None]]] = {}
        self._stopping = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._background: set[asyncio.Future[Any]] = set()

    async def run(self) -> None:
        """Claim and run attempts until `stop()`."""
        listener = asyncio.create_task(self._listen_for_cancels(), name="cancel-listener")
        try:
            while not self._stopping.is_set():
                await self._slots.acquire()
                if self._stopping.is_set():
                    self._slots.release()
                    break
                try:
                    assignment = await self._claim()
                except BaseException:
                    self._slots.release()
                    raise
                if assignment is None:
                    self._slots.release()
                    continue
                task = asyncio.create_task(
                    self._supervise(assignment), name=f"attempt-{assignment.run_id}"
                )
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        finally:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener

    async def _claim(self) -> Assignment | None:
        claim_task = asyncio.ensure_future(
            self._orchestrator.claim(self._worker_id, self._claim_wait_ms)
        )
        stop_task = asyncio.ensure_future(self._stopping.wait())
        try:
            done, _ = await asyncio.wait(
                {claim_task, stop_task}, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            stop_task.cancel()
        if claim_task not in done:
            # Stopping: a claim that still lands is handed back untouched.
            claim_task.add_done_callback(self._release_late_claim)
            claim_task.cancel()
            return None
        try:
            return claim_task.result()
        except (Unavailable, TetherError) as exc:
            log.warning("claim failed (%s); retrying", exc)
            await asyncio.sleep(0.5)  # orchestrator briefly unreachable; back off a little
            return None

    def _release_late_claim(self, task: asyncio.Future[Assignment | None]) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        assignment = task.result()
        if assignment is not None:
            release = asyncio.ensure_future(self._orchestrator.release(assignment.lease))
            self._background.add(release)
            release.add_done_callback(self._background.discard)

    async def _supervise(self, assignment: Assignment) -> None:
        attempt = self._make_attempt(assignment)
        run_id = assignment.run_id
        task = asyncio.create_task(attempt.execute(), name=f"execute-{run_id}")
        self._running[run_id] = (attempt, task)
        heartbeat = asyncio.create_task(self._heartbeat(attempt, task), name=f"hb-{run_id}")
        try:
            await task
        except asyncio.CancelledError:
            if attempt.cancel_reason is None and not task.cancelled():
                raise
            await self._after_cancel(attempt)
        except StaleLease:
            log.warning("run %s: lease lost; another worker owns it now", run_id)
        except Unavailable as exc:
            # Not a crash of the run: finalising it as failed could succeed a moment later
            # (the orchestrator or its database back) and fail it for good. Stop here; the
            # lease lapses and the reaper requeues the run, as if this worker had died.
            log.warning(
                "run %s: stopped, %s; the run is requeued when its lease lapses", run_id, exc
            )
        except Exception:
            log.exception("run %s: attempt crashed", run_id)
            await self._crashed(attempt)
        finally:
            heartbeat.cancel()
            self._running.pop(run_id, None)
            self._slots.release()

    async def _after_cancel(self, attempt: Attempt) -> None:
        try:
            if attempt.cancel_reason == "shutdown":
                await attempt.outcomes.released()
            else:
                await attempt.outcomes.cancelled(attempt.cancel_reason)
        except StaleLease:
            pass

    async def _crashed(self, attempt: Attempt) -> None:
        # An unexpected exception is still an outcome: finalise as failed rather than leave
        # the run running until its lease expires.
        try:
            await attempt.outcomes.finish(
                Failed(RunError("worker_error", "the worker hit an unexpected error", True))
            )
        except Exception as exc:  # the lease is gone or the orchestrator too: the reaper ends it
            log.warning("run %s: could not record the crash (%s)", attempt.run_id, exc)

    async def _heartbeat(self, attempt: Attempt, task: asyncio.Task[None]) -> None:
        while not task.done():
            await asyncio.sleep(self._heartbeat_interval)
            if not await self._beat(attempt):
                return

    async def _beat(self, attempt: Attempt) -> bool:
        """One heartbeat; the cancel it reports (the durable request) stops the attempt.
        False once the lease is gone."""
        try:
            cancel_requested = await self._orchestrator.heartbeat(attempt.lease)
        except StaleLease as exc:
            attempt.stop_with(exc)  # fenced out: stop spending on a run we no longer own
            return False
        except TetherError as exc:
            log.warning("heartbeat for %s failed: %s", attempt.run_id, exc)
            return True
        if cancel_requested:
            self.cancel(attempt.run_id, "cancelled by caller")
        return True

    def _cancel_hinted(self, run_id: str) -> None:
        """A cancel hint came through Redis: ask the orchestrator now, and act on its answer."""
        entry = self._running.get(run_id)
        if entry is None or entry[0].cancel_reason is not None:
            return
        check = asyncio.ensure_future(self._beat(entry[0]))
        self._background.add(check)
        check.add_done_callback(self._background.discard)

    def cancel(self, run_id: str, reason: str) -> None:
        """Cancel a running attempt (provider stream and tool tasks go with it)."""
        entry = self._running.get(run_id)
        if entry is None:
            return
        attempt, task = entry
        if attempt.cancel_reason is None:
            attempt.cancel_reason = reason
            task.cancel()

    async def _listen_for_cancels(self) -> None:
        if self._bus is None:
            return
        # Heartbeats still carry the cancel flag while Redis is away; only the fast path is lost.
        listener = Subscription(
            self._bus.url,
            "cancel-listener",
            lambda message: self._cancel_hinted(run_of_cancel_channel(message.channel)),
            patterns=[CANCEL_PATTERN],
        )
        await listener.run()

    async def stop(self, grace_s: float) -> None:
        """Stop claiming; give attempts `grace_s` to finish, then release their leases."""
        self._stopping.set()
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=grace_s)
            if pending:
                for run_id in list(self._running):
                    self.cancel(run_id, "shutdown")
                await asyncio.wait(pending, timeout=max(grace_s / 2, 1.0))
