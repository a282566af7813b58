"""How an attempt reports its end to the orchestrator: an ending (completed, failed, cancelled),
or the run handed back (parked, released, retry-pending).

An ending closes the calls left dangling (with why) and goes as one CompleteRun that also
carries everything the checkpoint writer had not yet written. A park, a release and a retry
hand the run back instead: their progress is made durable first, and the live deltas out
before the orchestrator's answer (which may supersede their parts) can overtake them.
"""

from __future__ import annotations

import time

from services.worker.checkpoints import CheckpointWriter
from services.worker.interactions import Parked
from services.worker.orchestrator_client import Orchestrator
from services.worker.transcript import Transcript
from tether.domain import (
    CANCELLED_BY_CALLER,
    Cancelled,
    Completed,
    Ending,
    Failed,
    Interruption,
    Lease,
    RunError,
)
from tether.domain.rules import REISSUED_CALLS
from tether.retry import ProviderFailure


def interruption(ending: Ending) -> Interruption | None:
    """Why an ending leaves the calls still open interrupted; None when it leaves them be (a
    resolved completion: the model answered, and no call waits on a person)."""
    if isinstance(ending, Completed):
        return None if ending.task_outcome == "resolved" else Interruption.LIMIT_REACHED
    if isinstance(ending, Failed):
        return Interruption.RUN_FAILED
    return Interruption.RUN_CANCELLED


def ms_since(start: float) -> float:
    """Milliseconds since `start` (a `time.monotonic()` reading), to the microsecond: a stage
    duration as the attempt's row stores it (more digits are noise that costs bytes)."""
    return round((time.monotonic() - start) * 1000, 3)


class Outcomes:
    """Reports one leased attempt's outcome; `stages` are the timings sent with it."""

    def __init__(
        self,
        *,
        orchestrator: Orchestrator,
        lease: Lease,
        transcript: Transcript,
        checkpoints: CheckpointWriter,
    ) -> None:
        self._orchestrator = orchestrator
        self._lease = lease
        self._transcript = transcript
        self._checkpoints = checkpoints
        self.started = time.monotonic()
        self.stages: dict[str, float] = {}

    async def finish(self, ending: Ending, *, interrupted: Interruption | None = None) -> None:
        """End the run with `ending`: the calls left dangling are closed first, as interrupted
        for `interrupted` (by default, for what `interruption` says of the ending)."""
        final_start = time.monotonic()
        reason = interrupted or interruption(ending)
        if reason is not None:
            self._transcript.close_dangling(reason)
        handover = self._checkpoints.seal()
        self.stages["finalisation_ms"] = ms_since(final_start)
        self.stages["total_ms"] = ms_since(self.started)
        await self._orchestrator.complete(
            self._lease,
            ending,
            rest=handover.rest,
            in_flight=handover.in_flight,
            stages=self.stages,
        )

    async def cancelled(self, reason: str | None) -> None:
        """End the run cancelled: dangling calls closed as interrupted."""
        await self.finish(Cancelled(reason or CANCELLED_BY_CALLER))

    async def parked(self, parked: Parked) -> None:
        """Park the run on its interaction once everything before the pause is durable (the
        orchestrator parked it already when `parked.done`)."""
        if parked.done:
            return
        await self._checkpoints.sync()
        await self._orchestrator.park(
            self._lease,
            parked.status,
            parked.interaction_id,
            wake_at=parked.wake_at,
            tool_call_id=parked.tool_call_id,
            tool_call_ids=parked.tool_call_ids,
        )

    async def released(self) -> None:
        """Graceful shutdown: persist progress, close open calls, hand the lease back."""
        # The run is queued again: its next attempt issues its delegate calls again and finds
        # their children (as after a lost lease).
        self._transcript.close_dangling(Interruption.WORKER_SHUT_DOWN, keep=REISSUED_CALLS)
        await self._checkpoints.sync()
        await self._checkpoints.deltas_out()
        await self._orchestrator.release(self._lease)

    async def provider_failed(self, failure: ProviderFailure) -> None:
        """A retryable provider failure hands the run to the retry scheduler; any other
        fails it."""
        error = RunError(str(failure.code), failure.message, failure.retryable, failure.status or 0)
        if failure.retryable:
            await self.retry_later(error, failure.retry_after or 0.0)
            return
        await self.finish(Failed(error), interrupted=Interruption.MODEL_CALL_FAILED)

    async def retry_later(self, error: RunError, retry_after_s: float = 0.0) -> None:
        """Hand the run to the retry scheduler once its progress is durable: the next attempt
        streams the cut-off turn anew."""
        await self._checkpoints.sync()
        await self._checkpoints.deltas_out()
        await self._orchestrator.schedule_retry(self._lease, error, retry_after_s)
