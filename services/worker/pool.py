"""The worker pool: runs the attempts the orchestrator pushes on the Work stream, with bounded
concurrency (one credit per free slot), and shuts down gracefully.

The stream's keepalive renews every lease the pool holds in one statement, with how long each
attempt has gone without progress; its answer carries the durable cancel requests (pushed as
cancels) and the leases that are gone (pushed as lost: their attempts stop at once). An attempt
that makes no progress for the orchestrator's progress deadline is cancelled here and its run
handed to the retry scheduler; were this worker itself hung, its leases would not be renewed
and the reaper would requeue its runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from opentelemetry.trace import Span

from services.worker import observed
from services.worker.attempt import Attempt
from services.worker.work_stream import Held, WorkStream
from tether.domain import CANCELLED_BY_CALLER, Assignment, Failed, Rendered, RenderJob, RunError
from tether.errors import StaleLease, Unavailable

log = logging.getLogger(__name__)

# Why the pool cancels an attempt, besides a caller's request.
SHUTDOWN = "shutdown"
NO_PROGRESS = "no progress"


class WorkerPool:
    """Runs the attempts pushed to this worker until stopped."""

    def __init__(
        self,
        *,
        stream: WorkStream,
        make_attempt: Callable[[Assignment], Attempt],
        concurrency: int,
        render: Callable[[RenderJob], Awaitable[Rendered]] | None = None,
    ) -> None:
        self._stream = stream
        self._make_attempt = make_attempt
        self._render = render
        self._concurrency = concurrency
        self._running: dict[str, tuple[Attempt, asyncio.Task[None]]] = {}
        self._stopping = False
        # Each attempt's supervisor: it reports how the attempt ended, then frees the slot.
        self._supervised: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        """Take the attempts pushed to this worker until `stop()`."""
        self._stream.grant(self._concurrency)
        watchdog = asyncio.ensure_future(self._watch_progress())
        try:
            await self._stream.run(self)
        finally:
            watchdog.cancel()

    # -- what the stream hands the pool ---------------------------------------------------------

    def leased(self, assignment: Assignment) -> None:
        """Run a pushed lease (one credit spent on it)."""
        if self._stopping:
            # Granted before the stop: hand it back untouched.
            handing = asyncio.ensure_future(self._hand_back(assignment))
            self._supervised.add(handing)
            handing.add_done_callback(self._supervised.discard)
            return
        earlier = self._running.get(assignment.run_id)
        if earlier is not None:
            # Leased again: the attempt still here lost its lease (the orchestrator reaped it),
            # so it stops, and the new lease runs.
            old = earlier[0].lease
            earlier[0].stop_with(StaleLease(f"lease epoch {old.epoch} of run {old.run_id} lapsed"))
        attempt = self._make_attempt(assignment)
        # Both tasks start in it: its run bound to their logs, and its span while telemetry is on.
        context, span = observed.attempt_context(assignment)
        context.run(self._start, attempt, span)

    def _start(self, attempt: Attempt, span: Span | None) -> None:
        task = attempt.start()
        task.set_name(f"attempt-{attempt.run_id}")
        self._running[attempt.run_id] = (attempt, task)
        supervised = asyncio.ensure_future(self._supervise(attempt, task, span))
        self._supervised.add(supervised)
        supervised.add_done_callback(self._supervised.discard)

    def cancelled(self, run_id: str, epoch: int) -> None:
        """A caller asked to cancel a run this worker holds (the durable request)."""
        entry = self._running.get(run_id)
        if entry is not None and entry[0].lease.epoch == epoch:
            self.cancel(run_id, CANCELLED_BY_CALLER)

    def lost(self, run_id: str, epoch: int) -> None:
        """The lease is gone: stop spending on a run this worker no longer owns."""
        entry = self._running.get(run_id)
        if entry is not None and entry[0].lease.epoch == epoch:
            entry[0].stop_with(StaleLease(f"lease epoch {epoch} of run {run_id} was lost"))

    def held(self) -> Sequence[Held]:
        """Every lease this worker holds, with how long its attempt has made no progress."""
        now = time.monotonic()
        return [
            Held(attempt.lease.run_id, attempt.lease.epoch, now - attempt.progressed_at)
            for attempt, _ in self._running.values()
        ]

    def render(self, job: RenderJob) -> None:
        """Build a render job's request beside the attempts (it takes no slot: it calls no
        model) and answer it on the stream."""
        rendering = asyncio.ensure_future(self._answer_render(job))
        self._supervised.add(rendering)
        rendering.add_done_callback(self._supervised.discard)

    async def _answer_render(self, job: RenderJob) -> None:
        if self._render is None:
            rendered = Rendered(
                job.render_id,
                {},
                error_code="render_unsupported",
                error_message="this worker builds no renders",
            )
        else:
            try:
                rendered = await self._render(job)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("render %d failed", job.render_id)
                rendered = Rendered(
                    job.render_id,
                    {},
                    error_code="render_failed",
                    error_message=f"the worker could not build the request: {type(exc).__name__}",
                )
        self._stream.rendered(rendered)

    # -- an attempt -----------------------------------------------------------------------------

    async def _supervise(
        self, attempt: Attempt, task: asyncio.Task[None], span: Span | None
    ) -> None:
        run_id = attempt.run_id
        error: BaseException | None = None
        try:
            await task
        except asyncio.CancelledError:
            if attempt.cancel_reason is None and not task.cancelled():
                raise
            await self._after_cancel(attempt)
        except StaleLease as exc:
            error = exc
            log.warning("run %s: lease lost; another worker owns it now", run_id)
        except Unavailable as exc:
            error = exc
            # Not a crash of the run: finalising it as failed could succeed a moment later
            # (the orchestrator or its database back) and fail it for good. Stop here; the
            # lease lapses and the reaper requeues the run, as if this worker had died.
            log.warning(
                "run %s: stopped, %s; the run is requeued when its lease lapses", run_id, exc
            )
        except Exception as exc:
            error = exc
            log.exception("run %s: attempt crashed", run_id)
            await self._crashed(attempt)
        finally:
            if span is not None:
                observed.attempt_ended(span, attempt.cancel_reason, error)
            if self._running.get(run_id, (None,))[0] is attempt:
                del self._running[run_id]
            if not self._stopping:
                self._stream.slot_freed(run_id, attempt.lease.epoch)

    async def _after_cancel(self, attempt: Attempt) -> None:
        try:
            if attempt.cancel_reason == SHUTDOWN:
                await attempt.outcomes.released()
            elif attempt.cancel_reason == NO_PROGRESS:
                await attempt.outcomes.retry_later(
                    RunError(
                        "no_progress",
                        f"the attempt made no progress for {self._stream.progress_deadline_s:g} s",
                        retryable=True,
                    )
                )
            else:
                await attempt.abandon_delivery("the run was cancelled")
                await attempt.outcomes.cancelled(attempt.cancel_reason)
        except StaleLease:
            pass
        except Exception:  # the lease lapses and the reaper ends the run
            log.exception("run %s: could not report how it was stopped", attempt.run_id)

    async def _crashed(self, attempt: Attempt) -> None:
        # An unexpected exception is still an outcome: finalise as failed rather than leave
        # the run running until its lease expires.
        try:
            await attempt.abandon_delivery("the worker hit an unexpected error")
            await attempt.outcomes.finish(
                Failed(RunError("worker_error", "the worker hit an unexpected error", True))
            )
        except Exception as exc:  # the lease is gone or the orchestrator too: the reaper ends it
            log.warning("run %s: could not record the crash (%s)", attempt.run_id, exc)

    async def _hand_back(self, assignment: Assignment) -> None:
        try:
            await self._make_attempt(assignment).outcomes.released()
        except Exception as exc:  # the reaper requeues it when the lease lapses
            log.warning("run %s: could not hand back its lease (%s)", assignment.run_id, exc)

    async def _watch_progress(self) -> None:
        """Cancel an attempt that made no progress for the progress deadline (a hung model
        stream or tool): its run is retried. Checked at a tenth of the deadline, the one the
        orchestrator gives (it stops renewing such a lease at that deadline)."""
        await self._stream.connected.wait()
        while True:
            deadline = self._stream.progress_deadline_s
            await asyncio.sleep(deadline / 10)
            now = time.monotonic()
            for run_id, (attempt, _) in list(self._running.items()):
                if now - attempt.progressed_at > deadline:
                    log.warning("run %s: no progress for %.0f s; cancelling", run_id, deadline)
                    self.cancel(run_id, NO_PROGRESS)

    def cancel(self, run_id: str, reason: str) -> None:
        """Cancel a running attempt (provider stream and tool tasks go with it); one whose
        outcome was sent already is left to land (`Attempt.cancel`)."""
        entry = self._running.get(run_id)
        if entry is not None:
            entry[0].cancel(reason)

    async def stop(self, grace_s: float) -> None:
        """Take no more runs; give attempts `grace_s` to finish, then release their leases,
        and say goodbye."""
        self._stopping = True
        self._stream.goodbye()
        if self._supervised:
            _, pending = await asyncio.wait(set(self._supervised), timeout=grace_s)
            if pending:
                for run_id in list(self._running):
                    self.cancel(run_id, SHUTDOWN)
                await asyncio.wait(pending, timeout=max(grace_s / 2, 1.0))
        await self._stream.close()
