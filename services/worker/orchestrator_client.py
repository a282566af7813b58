"""The worker's only authority: calls to the orchestrator under a lease. Failures arrive as
TetherErrors (StaleLease for a refused epoch): the channel translates them."""

from __future__ import annotations

from typing import Any, TypeVar

from google.protobuf import json_format

from services.worker.tools.effects import EffectState
from tether.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc

T = TypeVar("T")

_EFFECT_STATES = {
    orchestrator_pb2.EFFECT_STATE_BEGUN: EffectState.BEGUN,
    orchestrator_pb2.EFFECT_STATE_IN_PROGRESS: EffectState.IN_PROGRESS,
    orchestrator_pb2.EFFECT_STATE_DONE: EffectState.DONE,
}


class Orchestrator:
    """Typed calls to tether.v1.OrchestratorService."""

    def __init__(self, stub: orchestrator_pb2_grpc.OrchestratorServiceStub) -> None:
        self.stub = stub

    async def claim(self, worker_id: str, wait_ms: int) -> orchestrator_pb2.ClaimRunResponse:
        """Long-poll for a run."""
        response: orchestrator_pb2.ClaimRunResponse = await self.stub.ClaimRun(
            orchestrator_pb2.ClaimRunRequest(worker_id=worker_id, wait_ms=wait_ms),
            timeout=wait_ms / 1000 + 30,
        )
        return response

    async def heartbeat(self, run_id: str, epoch: int) -> orchestrator_pb2.HeartbeatResponse:
        """Extend the lease."""
        response: orchestrator_pb2.HeartbeatResponse = await self.stub.Heartbeat(
            orchestrator_pb2.HeartbeatRequest(run_id=run_id, epoch=epoch)
        )
        return response

    async def checkpoint(
        self, request: orchestrator_pb2.CheckpointRequest
    ) -> orchestrator_pb2.CheckpointResponse:
        """Persist progress."""
        response: orchestrator_pb2.CheckpointResponse = await self.stub.Checkpoint(request)
        return response

    async def complete(self, request: orchestrator_pb2.CompleteRunRequest) -> None:
        """Finalise the run."""
        await self.stub.CompleteRun(request)

    async def schedule_retry(
        self, run_id: str, epoch: int, error: common_pb2.ErrorInfo, retry_after_s: float
    ) -> orchestrator_pb2.ScheduleRetryResponse:
        """Report a transient failure."""
        response: orchestrator_pb2.ScheduleRetryResponse = await self.stub.ScheduleRetry(
            orchestrator_pb2.ScheduleRetryRequest(
                run_id=run_id, epoch=epoch, error=error, retry_after_seconds=retry_after_s
            )
        )
        return response

    async def park(
        self,
        run_id: str,
        epoch: int,
        status: common_pb2.RunStatus.ValueType,
        interaction_id: str,
    ) -> None:
        """Park the run for a person; the lease is released."""
        await self.stub.ParkRun(
            orchestrator_pb2.ParkRunRequest(
                run_id=run_id, epoch=epoch, status=status, interaction_id=interaction_id
            )
        )

    async def release(self, run_id: str, epoch: int) -> None:
        """Hand the lease back."""
        await self.stub.ReleaseRun(orchestrator_pb2.ReleaseRunRequest(run_id=run_id, epoch=epoch))


class LeasedEffects:
    """The effects record over gRPC, fenced by one lease (implements EffectsPort)."""

    def __init__(self, orchestrator: Orchestrator, run_id: str, epoch: int) -> None:
        self._orchestrator = orchestrator
        self._run_id = run_id
        self._epoch = epoch

    async def begin(self, key: str, tool_name: str) -> tuple[EffectState, dict[str, Any] | None]:
        """Open the record."""
        response: orchestrator_pb2.BeginEffectResponse = await self._orchestrator.stub.BeginEffect(
            orchestrator_pb2.BeginEffectRequest(
                run_id=self._run_id, epoch=self._epoch, key=key, tool_name=tool_name
            )
        )
        state = _EFFECT_STATES[response.state]
        result = json_format.MessageToDict(response.result) if state is EffectState.DONE else None
        return state, result

    async def finish(self, key: str, result: dict[str, Any]) -> None:
        """Store the result."""
        request = orchestrator_pb2.FinishEffectRequest(
            run_id=self._run_id, epoch=self._epoch, key=key
        )
        json_format.ParseDict(result, request.result)
        await self._orchestrator.stub.FinishEffect(request)
