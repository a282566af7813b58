"""The orchestrator's worker-facing edge: the writes a worker makes under its leases, as unary
calls and on its Work stream, and the leases pushed to it. Protobuf stops here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from services.orchestrator import observed
from services.orchestrator.claims import Claimed
from services.orchestrator.execution import Execution
from services.orchestrator.knowledge import Knowledge
from services.orchestrator.lease_histories import (
    HeldRun,
    StreamHistories,
    history_parts,
    spans,
    split,
    with_history,
)
from services.orchestrator.work import Work, Write
from tether import telemetry
from tether.convert import (
    error_from_proto,
    error_to_proto,
    part_from_proto,
    run_to_proto,
    status_from_proto,
    status_to_proto,
    timestamp,
)
from tether.convert.deliveries import delivery_to_proto
from tether.convert.work import (
    OUTCOMES,
    WRITE_FIELDS,
    assignment_to_proto,
    checkpoint_from_proto,
    completion_from_proto,
    effect_to_proto,
    events_from_proto,
)
from tether.domain import Assignment, EarlierRun, EffectState, Lease, Part
from tether.domain.runs import Run
from tether.errors import InvalidArgument
from tether.states import RunStatus
from tether.telemetry import metrics, tracing
from tether.telemetry.logs import bind_run
from tether.v1 import orchestrator_pb2

# The unary write handlers never read their context: the Work stream calls them with none.
_NO_CONTEXT: Any = None
# What a completion on a Work stream is acknowledged with.
_MOVED = orchestrator_pb2.CompleteRunResponse(moved=True)


def _assignment(
    claimed: Claimed,
    traceparent: str,
    history: list[Part],
    earlier_runs: tuple[EarlierRun, ...],
) -> Assignment:
    """What a claim hands the worker: `history` is the earlier runs' parts it sends (each
    run's input, a user part with index -1, then its transcript), spanned by `earlier_runs`
    (those the worker holds first), then the run's own parts."""
    run = claimed.run
    own = list(claimed.own)
    return Assignment(
        lease=Lease(run.run_id, run.lease_epoch, run.attempt),
        tenant_id=run.tenant_id,
        root_run_id=run.root_run_id or "",
        input_text=run.input_text,
        config=claimed.config,
        history=tuple(history + own),
        prior_part_count=len(history),
        last_seq=run.last_seq,
        traceparent=traceparent,
        origin=claimed.origin,
        has_documents=claimed.has_documents,
        summary_part=claimed.summary,
        earlier_runs=earlier_runs,
        last_turn_tokens=claimed.last_turn.tokens,
        last_turn_own=claimed.last_turn.own,
        ended_children=claimed.ended_children,
    )


def lease_response(
    claimed: Claimed, histories: StreamHistories | None = None, limit_runs: int = 0
) -> orchestrator_pb2.ClaimRunResponse:
    """A lease with the attempt's explicit inputs, as the worker receives it: with the
    histories a Work stream's worker holds (and the claim did not read again), only the rest of
    its history (see `lease_histories`)."""
    run = claimed.run
    traceparent = (
        observed.claimed(run, claimed.queued_at, claimed.routing_ms)
        if telemetry.on
        else run.traceparent or ""
    )
    if histories is None:
        held: list[HeldRun] = []
        new = list(claimed.earlier)
    else:
        held, new = split(claimed, histories, limit_runs)
    response = assignment_to_proto(
        _assignment(claimed, traceparent, history_parts(new), spans(held, new)),
        expires_at=run.lease_expires_at,
        run=run_to_proto(run),
    )
    if histories is None:
        return response
    return with_history(response, claimed, histories, held, new)


class ExecutionServicer:
    """The lease side of tether.v1.OrchestratorService, mixed into OrchestratorServicer: the
    unary calls (the previous release's workers still claim and heartbeat with them during a
    rolling deploy) and the Work stream."""

    _execution: Execution
    _knowledge: Knowledge
    work: Work

    def _work_writes(self) -> Mapping[type[Message], Write]:
        """The writes a Work stream carries, by their request type: each runs as its unary
        call."""
        unary: dict[type[Message], Any] = {
            orchestrator_pb2.CheckpointRequest: self.Checkpoint,
            orchestrator_pb2.CompleteRunRequest: self._streamed_completion,
            orchestrator_pb2.ParkRunRequest: self.ParkRun,
            orchestrator_pb2.ScheduleRetryRequest: self.ScheduleRetry,
            orchestrator_pb2.ReleaseRunRequest: self.ReleaseRun,
            orchestrator_pb2.BeginEffectRequest: self.BeginEffect,
            orchestrator_pb2.FinishEffectRequest: self.FinishEffect,
            orchestrator_pb2.StoreToolOutputRequest: self.StoreToolOutput,
            orchestrator_pb2.RetrieveKnowledgeRequest: self.RetrieveKnowledge,
            orchestrator_pb2.StoreSummaryRequest: self.StoreSummary,
            orchestrator_pb2.BeginDeliveryRequest: self.BeginDelivery,
            orchestrator_pb2.RecordDeliveryRequest: self.RecordDelivery,
            orchestrator_pb2.FindChannelStatusRequest: self.FindChannelStatus,
            # Only on the Work stream: no unary call starts a child.
            orchestrator_pb2.StartChildRequest: self._start_child,
        }

        def write(call: Any) -> Write:
            async def run(request: Any) -> Any:
                bind_run(request.run_id)
                return await call(request, _NO_CONTEXT)

            return run

        def traced(kind: type[Message], call: Any) -> Write:
            # The attempt's trace context comes inside the message: the stream has none. A
            # write without one (its worker's telemetry is off) makes no span here either.
            async def run(request: Any) -> Any:
                bind_run(request.run_id)
                if not request.traceparent:
                    return await call(request, _NO_CONTEXT)
                with tracing.span(
                    f"tether.{WRITE_FIELDS[kind]}",
                    parent=request.traceparent,
                    run_id=request.run_id,
                    attributes={
                        "tether.run.id": request.run_id,
                        "tether.lease.epoch": request.epoch,
                    },
                ):
                    return await call(request, _NO_CONTEXT)

            return run

        return {
            kind: traced(kind, call) if telemetry.on and kind in OUTCOMES else write(call)
            for kind, call in unary.items()
        }

    async def Work(
        self,
        request_iterator: Any,
        context: grpc.aio.ServicerContext,
    ) -> Any:
        async for response in self.work.serve(request_iterator):
            yield response

    async def ClaimRun(
        self, request: orchestrator_pb2.ClaimRunRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.ClaimRunResponse:
        if not request.worker_id:
            raise InvalidArgument("worker_id is required")
        wait_s = min(max(request.wait_ms, 0), 60_000) / 1000
        claimed = await self._execution.claims.claim(request.worker_id, wait_s)
        if claimed is None:
            return orchestrator_pb2.ClaimRunResponse(claimed=False)
        return lease_response(claimed)

    async def Heartbeat(
        self, request: orchestrator_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.HeartbeatResponse:
        row = await self._execution.attempts.heartbeat(request.run_id, request.epoch)
        return orchestrator_pb2.HeartbeatResponse(
            expires_at=timestamp(row.lease_expires_at),
            cancel_requested=row.cancel_requested_at is not None,
        )

    async def Checkpoint(
        self, request: orchestrator_pb2.CheckpointRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.CheckpointResponse:
        row = await self._execution.attempts.checkpoint(
            request.run_id, request.epoch, checkpoint_from_proto(request)
        )
        return orchestrator_pb2.CheckpointResponse(
            last_seq=row.last_seq, cancel_requested=row.cancel_requested_at is not None
        )

    async def ParkRun(
        self, request: orchestrator_pb2.ParkRunRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.ParkRunResponse:
        status = status_from_proto(request.status)
        if status is RunStatus.WAITING_FOR_TIMER:
            if not request.HasField("wake_at"):
                raise InvalidArgument("wake_at is required to park a run waiting-for-timer")
            moved = await self._execution.timers.park(
                request.run_id,
                request.epoch,
                request.wake_at.ToDatetime(UTC),
                request.tool_call_id,
            )
            return orchestrator_pb2.ParkRunResponse(moved=moved)
        if status is RunStatus.WAITING_FOR_CHILDREN:
            moved = await self._execution.children.park(
                request.run_id, request.epoch, list(request.tool_call_ids)
            )
            return orchestrator_pb2.ParkRunResponse(moved=moved)
        if status is None or not status.waiting:
            raise InvalidArgument("status must be one of the waiting-for-* statuses")
        moved = await self._execution.pauses.park(
            request.run_id, request.epoch, status, request.interaction_id
        )
        return orchestrator_pb2.ParkRunResponse(moved=moved)

    async def ResumeRun(
        self, request: orchestrator_pb2.ResumeRunRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.ResumeRunResponse:
        status = status_from_proto(request.from_status)
        if status is None or not status.waiting:
            raise InvalidArgument("from_status must be one of the waiting-for-* statuses")
        event = events_from_proto([request.event])[0] if request.HasField("event") else None
        resumed = await self._execution.pauses.resume(
            request.tenant_id, request.run_id, status, event, request.interaction_id
        )
        return orchestrator_pb2.ResumeRunResponse(resumed=resumed)

    async def ScheduleRetry(
        self, request: orchestrator_pb2.ScheduleRetryRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.ScheduleRetryResponse:
        row = await self._execution.recovery.schedule_retry(
            request.run_id,
            request.epoch,
            error_from_proto(request.error),
            max(request.retry_after_seconds, 0.0),
        )
        return orchestrator_pb2.ScheduleRetryResponse(
            status=status_to_proto(row.status), next_attempt_at=timestamp(row.next_attempt_at)
        )

    async def CompleteRun(
        self, request: orchestrator_pb2.CompleteRunRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.CompleteRunResponse:
        row = await self._complete(request)
        return orchestrator_pb2.CompleteRunResponse(moved=True, run=run_to_proto(row))

    async def _streamed_completion(
        self, request: orchestrator_pb2.CompleteRunRequest, context: Any
    ) -> orchestrator_pb2.CompleteRunResponse:
        """CompleteRun on a Work stream: its acknowledgement carries no run (the worker has no
        use for it; building and sending it was about 3% of this replica's CPU per run)."""
        await self._complete(request)
        return _MOVED

    async def _complete(self, request: orchestrator_pb2.CompleteRunRequest) -> Run:
        done = completion_from_proto(request)
        if telemetry.on:
            metrics.stages(done.stages)
        return await self._execution.attempts.complete(request.run_id, request.epoch, done)

    async def ReleaseRun(
        self, request: orchestrator_pb2.ReleaseRunRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.ReleaseRunResponse:
        moved = await self._execution.attempts.release(request.run_id, request.epoch)
        return orchestrator_pb2.ReleaseRunResponse(moved=moved)

    async def BeginEffect(
        self, request: orchestrator_pb2.BeginEffectRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.BeginEffectResponse:
        if not request.key:
            raise InvalidArgument("key is required")
        state, result = await self._execution.attempts.begin_effect(
            request.run_id, request.epoch, request.key, request.tool_name
        )
        return effect_to_proto(EffectState(state), result)

    async def FinishEffect(
        self, request: orchestrator_pb2.FinishEffectRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.FinishEffectResponse:
        await self._execution.attempts.finish_effect(
            request.run_id, request.epoch, request.key, json_format.MessageToDict(request.result)
        )
        return orchestrator_pb2.FinishEffectResponse()

    async def BeginDelivery(
        self, request: orchestrator_pb2.BeginDeliveryRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.BeginDeliveryResponse:
        begun = await self._execution.deliveries.begin(
            request.run_id,
            request.epoch,
            channel_id=request.channel_id,
            kind=request.kind,
            text=request.text,
            awaiting_approval=request.awaiting_approval,
            find_only=request.find_only,
        )
        response = orchestrator_pb2.BeginDeliveryResponse(
            found=begun.delivery is not None, created=begun.created
        )
        if begun.delivery is not None:
            response.delivery.CopyFrom(delivery_to_proto(begun.delivery))
        return response

    async def RecordDelivery(
        self, request: orchestrator_pb2.RecordDeliveryRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.RecordDeliveryResponse:
        if not request.delivery_id:
            raise InvalidArgument("delivery_id is required")
        moved, delivery, expires_at = await self._execution.deliveries.record(
            request.run_id,
            request.epoch,
            request.delivery_id,
            state=request.state,
            provider_message_id=request.provider_message_id,
            error=error_from_proto(request.error) if request.HasField("error") else None,
            calls=request.calls,
        )
        response = orchestrator_pb2.RecordDeliveryResponse(
            moved=moved, delivery=delivery_to_proto(delivery)
        )
        response.lease_expires_at.FromDatetime(expires_at)
        return response

    async def _start_child(
        self, request: orchestrator_pb2.StartChildRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.StartChildResponse:
        child = await self._execution.children.start(
            request.run_id,
            request.epoch,
            tool_call_id=request.tool_call_id,
            agent=request.agent,
            message=request.message,
            max_depth=request.max_depth,
            max_children=request.max_children,
            share=request.share,
            park=list(request.park_tool_call_ids),
            new_call=request.new_call,
            checkpoint=(
                checkpoint_from_proto(request.checkpoint)
                if request.HasField("checkpoint")
                else None
            ),
        )
        error = child.error
        return orchestrator_pb2.StartChildResponse(
            child_run_id=child.run.run_id,
            status=status_to_proto(child.run.status),
            result_text=child.run.result_text or "",
            error=None if error is None else error_to_proto(error),
            created=child.created,
            parked=child.parked,
        )

    async def FindChannelStatus(
        self,
        request: orchestrator_pb2.FindChannelStatusRequest,
        context: grpc.aio.ServicerContext,
    ) -> orchestrator_pb2.FindChannelStatusResponse:
        if not request.callback_data:
            raise InvalidArgument("callback_data is required")
        found = await self._execution.deliveries.status(
            request.run_id, request.epoch, request.channel_id, request.callback_data
        )
        if found is None:
            return orchestrator_pb2.FindChannelStatusResponse(found=False)
        return orchestrator_pb2.FindChannelStatusResponse(
            found=True, provider_message_id=found.provider_message_id, status=found.status
        )

    async def ExpireWaitingRun(
        self,
        request: orchestrator_pb2.ExpireWaitingRunRequest,
        context: grpc.aio.ServicerContext,
    ) -> orchestrator_pb2.ExpireWaitingRunResponse:
        status = status_from_proto(request.from_status)
        if status is None:
            raise InvalidArgument("from_status is required")
        event = events_from_proto([request.event])[0] if request.HasField("event") else None
        expired = await self._execution.pauses.expire_waiting(
            request.tenant_id,
            request.run_id,
            status,
            error_from_proto(request.error),
            event,
            request.interaction_id,
        )
        return orchestrator_pb2.ExpireWaitingRunResponse(expired=expired)

    async def StoreToolOutput(
        self,
        request: orchestrator_pb2.StoreToolOutputRequest,
        context: grpc.aio.ServicerContext,
    ) -> orchestrator_pb2.StoreToolOutputResponse:
        if not request.output_ref:
            raise InvalidArgument("output_ref is required")
        await self._execution.attempts.store_tool_output(
            request.run_id, request.epoch, request.output_ref, request.content
        )
        return orchestrator_pb2.StoreToolOutputResponse()

    async def RetrieveKnowledge(
        self,
        request: orchestrator_pb2.RetrieveKnowledgeRequest,
        context: grpc.aio.ServicerContext,
    ) -> orchestrator_pb2.RetrieveKnowledgeResponse:
        matches = await self._knowledge.retrieve(
            request.run_id,
            request.epoch,
            request.query,
            limit=request.limit,
            max_chars=request.max_chars,
        )
        return orchestrator_pb2.RetrieveKnowledgeResponse(
            documents=[
                orchestrator_pb2.RetrievedDocument(
                    document_id=m.document_id, title=m.title, text=m.text, rank=m.rank
                )
                for m in matches
            ]
        )

    async def StoreSummary(
        self, request: orchestrator_pb2.StoreSummaryRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.StoreSummaryResponse:
        # A worker never marks a part superseded: the orchestrator alone decides that.
        part = replace(part_from_proto(request.part), superseded=False)
        row = await self._execution.attempts.store_summary(
            request.run_id, request.epoch, part, events_from_proto(request.events)
        )
        return orchestrator_pb2.StoreSummaryResponse(last_seq=row.last_seq)
