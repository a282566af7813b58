"""How an attempt reports its end to the orchestrator: completed, failed, cancelled, parked,
released, or retry-pending.

A terminal outcome closes the calls left dangling (with why) and goes as one CompleteRun that
also carries everything the checkpoint writer had not yet written. A park, a release and a
retry hand the run back instead: their progress is made durable first, and the live deltas out
before the orchestrator's answer (which may supersede their parts) can overtake them.
"""

from __future__ import annotations

import time
from typing import Any

from services.worker.checkpoints import CheckpointWriter
from services.worker.interactions import Parked
from services.worker.orchestrator_client import Orchestrator
from services.worker.transcript import Transcript
from tether.retry import ProviderFailure
from tether.v1 import common_pb2, orchestrator_pb2

# The stages the orchestrator records; the attempt may time others for itself.
_REPORTED_STAGES = ("routing_ms", "context_ms", "attempt_ms", "finalisation_ms", "total_ms")


class Outcomes:
    """Reports one leased attempt's outcome; `stages` are the timings sent with it."""

    def __init__(
        self,
        *,
        orchestrator: Orchestrator,
        run_id: str,
        epoch: int,
        transcript: Transcript,
        checkpoints: CheckpointWriter,
    ) -> None:
        self._orchestrator = orchestrator
        self._run_id = run_id
        self._epoch = epoch
        self._transcript = transcript
        self._checkpoints = checkpoints
        self.started = time.monotonic()
        self.stages: dict[str, float] = {}

    async def finish(self, kind: str, detail: dict[str, Any] | None) -> None:
        """Finalise as `kind`: "completed" (detail: `since`, `warnings`), "limit" (detail:
        `code`; completed, the task unresolved), or anything else as failed (detail: `code`,
        `message`, `retryable`)."""
        final_start = time.monotonic()
        request = orchestrator_pb2.CompleteRunRequest(run_id=self._run_id, epoch=self._epoch)
        detail = detail or {}
        if kind == "completed":
            request.status = common_pb2.RUN_STATUS_COMPLETED
            request.result_text = self._transcript.final_text(detail.get("since", 0))
            request.task_outcome = "resolved"
            request.warnings.extend(detail.get("warnings", []))
        elif kind == "limit":
            # Runtime completion is not business completion: the runtime answered, the task
            # may not be done.
            self._transcript.close_dangling("the run reached a limit")
            request.status = common_pb2.RUN_STATUS_COMPLETED
            request.result_text = self._transcript.final_text(0)
            request.task_outcome = "unresolved"
            request.warnings.extend([detail["code"], "budget_exhausted"])
        else:
            self._transcript.close_dangling("the run failed")
            request.status = common_pb2.RUN_STATUS_FAILED
            request.error.CopyFrom(
                common_pb2.ErrorInfo(
                    code=detail.get("code", "error"),
                    message=detail.get("message", ""),
                    retryable=bool(detail.get("retryable", False)),
                )
            )
        await self._complete(request, final_start)

    async def cancelled(self, reason: str | None) -> None:
        """Finalise as cancelled: dangling calls closed as interrupted."""
        final_start = time.monotonic()
        self._transcript.close_dangling("the run was cancelled")
        request = orchestrator_pb2.CompleteRunRequest(
            run_id=self._run_id,
            epoch=self._epoch,
            status=common_pb2.RUN_STATUS_CANCELLED,
            error=common_pb2.ErrorInfo(code="cancelled", message=reason or ""),
        )
        await self._complete(request, final_start)

    async def parked(self, parked: Parked) -> None:
        """Park the run on its interaction once everything before the pause is durable."""
        await self._checkpoints.sync()
        await self._orchestrator.park(
            self._run_id, self._epoch, parked.status, parked.interaction_id
        )

    async def released(self) -> None:
        """Graceful shutdown: persist progress, close open calls, hand the lease back."""
        self._transcript.close_dangling("the worker shut down")
        await self._checkpoints.sync()
        await self._checkpoints.deltas_out()
        await self._orchestrator.release(self._run_id, self._epoch)

    async def provider_failed(self, failure: ProviderFailure) -> None:
        """A retryable provider failure hands the run to the retry scheduler; any other
        fails it."""
        error = common_pb2.ErrorInfo(
            code=str(failure.code),
            message=failure.message,
            retryable=failure.retryable,
            provider_status=failure.status or 0,
        )
        if failure.retryable:
            await self._checkpoints.sync()
            await self._checkpoints.deltas_out()
            await self._orchestrator.schedule_retry(
                self._run_id, self._epoch, error, failure.retry_after or 0.0
            )
            return
        self._transcript.close_dangling("the model call failed")
        request = orchestrator_pb2.CompleteRunRequest(
            run_id=self._run_id, epoch=self._epoch, status=common_pb2.RUN_STATUS_FAILED, error=error
        )
        await self._complete(request, time.monotonic())

    async def _complete(self, request: orchestrator_pb2.CompleteRunRequest, start: float) -> None:
        self._checkpoints.seal(request)
        self.stages["finalisation_ms"] = (time.monotonic() - start) * 1000
        self.stages["total_ms"] = (time.monotonic() - self.started) * 1000
        request.stages.CopyFrom(
            orchestrator_pb2.StageDurations(
                **{k: v for k, v in self.stages.items() if k in _REPORTED_STAGES}
            )
        )
        await self._orchestrator.complete(request)
