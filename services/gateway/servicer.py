"""The public edge: authenticates every call, then forwards it to the service that owns it.

Tenant and principal always come from the API key. Errors from internal services are rebuilt
as TetherError so the caller sees the same status and message the owner chose.
"""

from __future__ import annotations

from typing import TypeVar

import grpc
from sqlalchemy.ext.asyncio import AsyncEngine

from services.gateway.auth import Authenticator
from services.gateway.forward import forward
from services.gateway.interactions import InteractionRpcs
from services.gateway.streaming import StreamingServicer
from services.gateway.streams import Streams
from tether import apikeys
from tether.apikeys import Principal
from tether.errors import InvalidArgument
from tether.ids import is_identifier
from tether.v1 import (
    admission_pb2,
    admission_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    interactions_pb2_grpc,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
)
from tether.visibility import viewer_of

T = TypeVar("T")


class GatewayServicer(StreamingServicer, InteractionRpcs, gateway_pb2_grpc.GatewayServiceServicer):
    """Implements tether.v1.GatewayService."""

    def __init__(
        self,
        *,
        auth: Authenticator,
        engine: AsyncEngine,
        admission: admission_pb2_grpc.AdmissionServiceStub,
        orchestrator: orchestrator_pb2_grpc.OrchestratorServiceStub,
        interactions: interactions_pb2_grpc.InteractionsServiceStub,
        streams: Streams,
    ) -> None:
        self._auth = auth
        self._streams = streams
        self._engine = engine
        self._admission = admission
        self._orchestrator = orchestrator
        self._interactions = interactions

    async def _caller(self, context: grpc.aio.ServicerContext, method: str) -> Principal:
        metadata = dict(context.invocation_metadata() or ())
        return await self._auth.authenticate(metadata, method)

    async def _admit(self, principal: Principal, **input_: object) -> admission_pb2.AdmitResponse:
        request = admission_pb2.AdmitRequest(
            caller=admission_pb2.Caller(
                tenant_id=principal.tenant_id, principal_id=principal.principal_id
            ),
            **input_,  # type: ignore[arg-type]
        )
        return await forward(self._admission.Admit(request))

    async def SendMessage(
        self, request: gateway_pb2.SendMessageRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.SendMessageResponse:
        principal = await self._caller(context, "SendMessage")
        admitted = await self._admit(
            principal,
            chat=admission_pb2.ChatInput(
                event_id=request.event_id,
                conversation_id=request.conversation_id,
                text=request.text,
                channel=request.channel,
                tenant_id=request.tenant_id,
            ),
        )
        return gateway_pb2.SendMessageResponse(disposition=admitted.disposition, run=admitted.run)

    async def SubmitEvent(
        self, request: gateway_pb2.SubmitEventRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.SubmitEventResponse:
        principal = await self._caller(context, "SubmitEvent")
        kind = request.WhichOneof("input")
        if kind is None:
            raise InvalidArgument("exactly one of messaging, task_status or decision is required")
        admitted = await self._admit(principal, **{kind: getattr(request, kind)})
        return gateway_pb2.SubmitEventResponse(disposition=admitted.disposition, run=admitted.run)

    async def GetRun(
        self, request: gateway_pb2.GetRunRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GetRunResponse:
        principal = await self._caller(context, "GetRun")
        found = await forward(
            self._orchestrator.LookupRun(
                orchestrator_pb2.LookupRunRequest(
                    tenant_id=principal.tenant_id,
                    principal_id=principal.principal_id,
                    all_runs=viewer_of(principal).all_runs,
                    run_id=request.run_id,
                )
            )
        )
        return gateway_pb2.GetRunResponse(run=found.run, parts=found.parts)

    async def ListRuns(
        self, request: gateway_pb2.ListRunsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListRunsResponse:
        principal = await self._caller(context, "ListRuns")
        page = await forward(
            self._orchestrator.SearchRuns(
                orchestrator_pb2.SearchRunsRequest(
                    tenant_id=principal.tenant_id,
                    principal_id=principal.principal_id,
                    all_runs=viewer_of(principal).all_runs,
                    statuses=request.statuses,
                    conversation_id=request.conversation_id,
                    page_size=request.page_size,
                    page_token=request.page_token,
                )
            )
        )
        return gateway_pb2.ListRunsResponse(runs=page.runs, next_page_token=page.next_page_token)

    async def CancelRun(
        self, request: gateway_pb2.CancelRunRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.CancelRunResponse:
        principal = await self._caller(context, "CancelRun")
        outcome = await forward(
            self._orchestrator.RequestCancellation(
                orchestrator_pb2.RequestCancellationRequest(
                    tenant_id=principal.tenant_id,
                    principal_id=principal.principal_id,
                    all_runs=viewer_of(principal).all_runs,
                    run_id=request.run_id,
                    reason=request.reason,
                )
            )
        )
        return gateway_pb2.CancelRunResponse(run=outcome.run, changed=outcome.changed)

    async def CreateApiKey(
        self, request: gateway_pb2.CreateApiKeyRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.CreateApiKeyResponse:
        await self._caller(context, "CreateApiKey")
        for name in ("tenant_id", "principal_id"):
            if not is_identifier(getattr(request, name), max_length=128):
                raise InvalidArgument(
                    f"{name} must be 1-128 characters of letters, digits and . _ : @ -"
                )
        scopes = list(request.scopes) or list(apikeys.CLIENT_SCOPES)
        unknown = sorted(set(scopes) - set(apikeys.ALL_SCOPES))
        if unknown:
            raise InvalidArgument(
                f"unknown scopes {unknown}; known scopes are {list(apikeys.ALL_SCOPES)}"
            )
        async with self._engine.begin() as conn:
            await apikeys.ensure_tenant(conn, request.tenant_id)
            secret, principal = await apikeys.create_key(
                conn, request.tenant_id, request.principal_id, scopes
            )
        return gateway_pb2.CreateApiKeyResponse(
            api_key=secret,
            key_id=principal.key_id,
            tenant_id=principal.tenant_id,
            principal_id=principal.principal_id,
            scopes=sorted(principal.scopes),
        )
