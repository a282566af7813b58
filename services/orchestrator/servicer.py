"""Orchestrator's gRPC edge."""

from __future__ import annotations

import grpc
from tether.convert import event_to_proto, part_to_proto, run_to_proto, status_from_proto
from tether.errors import InvalidArgument
from tether.states import RunStatus
from tether.v1 import orchestrator_pb2, orchestrator_pb2_grpc

from services.orchestrator.service import Runs


def _statuses(values: list[int]) -> list[RunStatus]:
    out = []
    for value in values:
        status = status_from_proto(value)
        if status is None:
            raise InvalidArgument(f"unknown run status filter {value}")
        out.append(status)
    return out


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServiceServicer):
    """Implements tether.v1.OrchestratorService."""

    def __init__(self, runs: Runs) -> None:
        self._runs = runs

    async def LookupRun(
        self, request: orchestrator_pb2.LookupRunRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.LookupRunResponse:
        view = await self._runs.lookup(request.tenant_id, request.run_id)
        return orchestrator_pb2.LookupRunResponse(
            run=run_to_proto(view.run), parts=[part_to_proto(p) for p in view.parts]
        )

    async def SearchRuns(
        self, request: orchestrator_pb2.SearchRunsRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.SearchRunsResponse:
        if request.page_size < 0:
            raise InvalidArgument("page_size must not be negative")
        rows, token = await self._runs.search(
            request.tenant_id,
            statuses=_statuses(list(request.statuses)),
            conversation_id=request.conversation_id,
            page_size=request.page_size,
            page_token=request.page_token,
        )
        return orchestrator_pb2.SearchRunsResponse(
            runs=[run_to_proto(r) for r in rows], next_page_token=token
        )

    async def ReadEvents(
        self, request: orchestrator_pb2.ReadEventsRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.ReadEventsResponse:
        if request.after_seq < 0 or request.limit < 0:
            raise InvalidArgument("after_seq and limit must not be negative")
        sliced = await self._runs.read_events(
            request.tenant_id,
            request.run_id,
            request.after_seq,
            request.limit,
            request.include_state,
        )
        response = orchestrator_pb2.ReadEventsResponse(
            events=[
                event_to_proto(e.run_id, e.seq, e.type, e.payload, e.created_at)
                for e in sliced.events
            ],
            has_more=sliced.has_more,
        )
        if sliced.view is not None:
            response.run.CopyFrom(run_to_proto(sliced.view.run))
            response.parts.extend(part_to_proto(p) for p in sliced.view.parts)
        return response

    async def RequestCancellation(
        self,
        request: orchestrator_pb2.RequestCancellationRequest,
        context: grpc.aio.ServicerContext,
    ) -> orchestrator_pb2.RequestCancellationResponse:
        outcome = await self._runs.request_cancellation(
            request.tenant_id, request.run_id, request.reason
        )
        return orchestrator_pb2.RequestCancellationResponse(
            run=run_to_proto(outcome.run), changed=outcome.changed
        )
