"""The run RPCs: send a message or submit an event (admitted on the gateway's AdmitStream),
read a run, its attempts or a page of runs, retry and cancel. Each names the caller's tenant,
principal and visibility from its key, never the request's."""

from __future__ import annotations

import grpc

from services.gateway.grpc.admissions import Admissions
from services.gateway.grpc.callers import Callers
from tether import apikeys, priorities
from tether.apikeys import Principal
from tether.errors import InvalidArgument, PermissionDenied
from tether.v1 import (
    admission_pb2,
    admission_pb2_grpc,
    gateway_pb2,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
)
from tether.visibility import viewer_of


class RunRpcs:
    """Implements the run part of tether.v1.GatewayService."""

    def __init__(
        self,
        callers: Callers,
        admissions: Admissions,
        admission: admission_pb2_grpc.AdmissionServiceStub,
        orchestrator: orchestrator_pb2_grpc.OrchestratorServiceStub,
    ) -> None:
        self._callers = callers
        self._admissions = admissions
        self._admission = admission
        self._orchestrator = orchestrator

    async def _admit(
        self, principal: Principal, context: grpc.aio.ServicerContext, **input_: object
    ) -> admission_pb2.AdmitResponse:
        request = admission_pb2.AdmitRequest(
            caller=admission_pb2.Caller(
                tenant_id=principal.tenant_id, principal_id=principal.principal_id
            ),
            **input_,  # type: ignore[arg-type]
        )
        return await self._admissions.admit(request, context.time_remaining())

    async def SendMessage(
        self, request: gateway_pb2.SendMessageRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.SendMessageResponse:
        principal = await self._callers.authenticated(context, "SendMessage", request)
        if request.priority:
            priorities.rank(request.priority)  # an unknown name is the caller's mistake first
            if apikeys.RUNS_PRIORITY not in principal.scopes:
                raise PermissionDenied(
                    f"naming a run's priority needs a key holding {apikeys.RUNS_PRIORITY}"
                )
        admitted = await self._admit(
            principal,
            context,
            chat=admission_pb2.ChatInput(
                event_id=request.event_id,
                conversation_id=request.conversation_id,
                text=request.text,
                channel=request.channel,
                tenant_id=request.tenant_id,
                priority=request.priority,
            ),
        )
        return gateway_pb2.SendMessageResponse(disposition=admitted.disposition, run=admitted.run)

    async def SubmitEvent(
        self, request: gateway_pb2.SubmitEventRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.SubmitEventResponse:
        principal = await self._callers.authenticated(context, "SubmitEvent", request)
        kind = request.WhichOneof("input")
        if kind is None:
            raise InvalidArgument("exactly one of messaging, task_status or decision is required")
        admitted = await self._admit(principal, context, **{kind: getattr(request, kind)})
        return gateway_pb2.SubmitEventResponse(disposition=admitted.disposition, run=admitted.run)

    async def GetRun(
        self, request: gateway_pb2.GetRunRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GetRunResponse:
        principal = await self._callers.authenticated(context, "GetRun", request)
        found = await self._orchestrator.LookupRun(
            orchestrator_pb2.LookupRunRequest(
                **viewer_of(principal).fields(),
                run_id=request.run_id,
                include_superseded=request.include_superseded,
            )
        )
        return gateway_pb2.GetRunResponse(run=found.run, parts=found.parts)

    async def ListRuns(
        self, request: gateway_pb2.ListRunsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListRunsResponse:
        principal = await self._callers.authenticated(context, "ListRuns", request)
        page = await self._orchestrator.SearchRuns(
            orchestrator_pb2.SearchRunsRequest(
                **viewer_of(principal).fields(),
                statuses=request.statuses,
                conversation_id=request.conversation_id,
                page_size=request.page_size,
                page_token=request.page_token,
                created_after=(
                    request.created_after if request.HasField("created_after") else None
                ),
                tree_root_run_id=request.tree_root_run_id,
            )
        )
        return gateway_pb2.ListRunsResponse(runs=page.runs, next_page_token=page.next_page_token)

    async def GetRunAttempts(
        self, request: gateway_pb2.GetRunAttemptsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GetRunAttemptsResponse:
        principal = await self._callers.authenticated(context, "GetRunAttempts", request)
        found = await self._orchestrator.LookupAttempts(
            orchestrator_pb2.LookupAttemptsRequest(
                **viewer_of(principal).fields(), run_id=request.run_id
            )
        )
        return gateway_pb2.GetRunAttemptsResponse(
            run=found.run, attempts=found.attempts, turns=found.turns, lineage=found.lineage
        )

    async def RetryRun(
        self, request: gateway_pb2.RetryRunRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.RetryRunResponse:
        principal = await self._callers.authenticated(context, "RetryRun", request)
        retried = await self._admission.ReclaimRun(
            admission_pb2.ReclaimRunRequest(
                **viewer_of(principal).fields(),
                run_id=request.run_id,
                actor_key_id="" if principal.is_operator else principal.key_id,
            )
        )
        return gateway_pb2.RetryRunResponse(disposition=retried.disposition, run=retried.run)

    async def CancelRun(
        self, request: gateway_pb2.CancelRunRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.CancelRunResponse:
        principal = await self._callers.authenticated(context, "CancelRun", request)
        outcome = await self._orchestrator.RequestCancellation(
            orchestrator_pb2.RequestCancellationRequest(
                **viewer_of(principal).fields(),
                run_id=request.run_id,
                reason=request.reason,
            )
        )
        return gateway_pb2.CancelRunResponse(run=outcome.run, changed=outcome.changed)
