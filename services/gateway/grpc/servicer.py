"""The public edge: authenticates every call, then forwards it to the service that owns it.

Tenant and principal always come from the API key. Errors from internal services are rebuilt
as TetherError so the caller sees the same status and message the owner chose.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TypeVar

import grpc
from google.protobuf.message import Message
from sqlalchemy.ext.asyncio import AsyncEngine

from services.gateway.auth import Authenticator
from services.gateway.grpc.admissions import Admissions
from services.gateway.grpc.documents import DocumentRpcs
from services.gateway.grpc.interactions import InteractionRpcs
from services.gateway.grpc.streaming import StreamingServicer
from services.gateway.grpc.tenants import TenantRpcs
from services.gateway.live.run_list import LiveListTiming, LiveRuns
from services.gateway.live.streams import Streams
from tether import apikeys, audit
from tether.apikeys import Principal
from tether.errors import InvalidArgument, NotFound, PermissionDenied
from tether.ids import is_identifier
from tether.limits import check_request
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


class GatewayServicer(
    StreamingServicer,
    InteractionRpcs,
    DocumentRpcs,
    TenantRpcs,
    gateway_pb2_grpc.GatewayServiceServicer,
):
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
        revocation_bound_s: float = 5.0,
        admissions: Admissions,
        live_runs: LiveRuns | None = None,
    ) -> None:
        self._auth = auth
        # How long a revoked key may still be trusted from a replica's cache (a tenant being
        # deleted goes only after that).
        self._revocation_bound_s = revocation_bound_s
        self._streams = streams
        self._live_runs = live_runs or LiveRuns(orchestrator, streams.hub, LiveListTiming())
        self._engine = engine
        self._admission = admission
        self._admissions = admissions
        self._orchestrator = orchestrator
        self._interactions = interactions

    async def _caller(
        self, context: grpc.aio.ServicerContext, method: str, request: Message
    ) -> Principal:
        """The authenticated caller, once `request` is within every field's limit."""
        metadata = dict(context.invocation_metadata() or ())
        principal = await self._auth.authenticate(metadata, method)
        check_request(request)
        return principal

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
        principal = await self._caller(context, "SendMessage", request)
        admitted = await self._admit(
            principal,
            context,
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
        principal = await self._caller(context, "SubmitEvent", request)
        kind = request.WhichOneof("input")
        if kind is None:
            raise InvalidArgument("exactly one of messaging, task_status or decision is required")
        admitted = await self._admit(principal, context, **{kind: getattr(request, kind)})
        return gateway_pb2.SubmitEventResponse(disposition=admitted.disposition, run=admitted.run)

    async def GetRun(
        self, request: gateway_pb2.GetRunRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GetRunResponse:
        principal = await self._caller(context, "GetRun", request)
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
        principal = await self._caller(context, "ListRuns", request)
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
            )
        )
        return gateway_pb2.ListRunsResponse(runs=page.runs, next_page_token=page.next_page_token)

    async def GetRunAttempts(
        self, request: gateway_pb2.GetRunAttemptsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GetRunAttemptsResponse:
        principal = await self._caller(context, "GetRunAttempts", request)
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
        principal = await self._caller(context, "RetryRun", request)
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
        principal = await self._caller(context, "CancelRun", request)
        outcome = await self._orchestrator.RequestCancellation(
            orchestrator_pb2.RequestCancellationRequest(
                **viewer_of(principal).fields(),
                run_id=request.run_id,
                reason=request.reason,
            )
        )
        return gateway_pb2.CancelRunResponse(run=outcome.run, changed=outcome.changed)

    async def CreateApiKey(
        self, request: gateway_pb2.CreateApiKeyRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.CreateApiKeyResponse:
        caller = await self._caller(context, "CreateApiKey", request)
        tenant_id = request.tenant_id or ("" if caller.is_operator else caller.tenant_id)
        for name, value in (("tenant_id", tenant_id), ("principal_id", request.principal_id)):
            if not is_identifier(value, max_length=128):
                raise InvalidArgument(
                    f"{name} must be 1-128 characters of letters, digits and . _ : @ -"
                )
        if not caller.is_operator and tenant_id != caller.tenant_id:
            # The same answer whether that tenant exists or not.
            raise PermissionDenied("a tenant's key creates keys only in its own tenant")
        scopes = list(request.scopes) or list(apikeys.CLIENT_SCOPES)
        unknown = sorted(set(scopes) - set(apikeys.ALL_SCOPES))
        if unknown:
            raise InvalidArgument(
                f"unknown scopes {unknown}; known scopes are {list(apikeys.ALL_SCOPES)}"
            )
        wider = sorted(set(scopes) - caller.scopes)
        if wider and not caller.is_operator:
            raise PermissionDenied(f"a key cannot grant scopes it does not hold: {wider}")
        expires_at = None
        if request.HasField("expires_at"):
            expires_at = request.expires_at.ToDatetime(tzinfo=UTC)
            if expires_at <= datetime.now(UTC):
                raise InvalidArgument("expires_at must be in the future")
        async with self._engine.begin() as conn:
            if caller.is_operator:
                await apikeys.ensure_tenant(conn, tenant_id)
            secret, created = await apikeys.create_key(
                conn, tenant_id, request.principal_id, scopes, expires_at=expires_at
            )
            await audit.record(
                conn,
                tenant_id=tenant_id,
                action="key.created",
                actor=_actor(caller),
                key_id=created.key_id,
                principal_id=created.principal_id,
                scopes=sorted(created.scopes),
                expires_at=None if expires_at is None else expires_at.isoformat(),
            )
        response = gateway_pb2.CreateApiKeyResponse(
            api_key=secret,
            key_id=created.key_id,
            tenant_id=created.tenant_id,
            principal_id=created.principal_id,
            scopes=sorted(created.scopes),
        )
        if request.HasField("expires_at"):
            response.expires_at.CopyFrom(request.expires_at)
        return response

    async def RevokeApiKey(
        self, request: gateway_pb2.RevokeApiKeyRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.RevokeApiKeyResponse:
        caller = await self._caller(context, "RevokeApiKey", request)
        absent = NotFound(f"API key {request.key_id!r} not found")
        if not is_identifier(request.key_id, max_length=128):
            raise absent
        async with self._engine.begin() as conn:
            found = await apikeys.revoke_key(
                conn, request.key_id, None if caller.is_operator else caller.tenant_id
            )
            if found is None:
                raise absent  # another tenant's key gets the same answer as an absent one
            key, revoked = found
            if revoked:
                await audit.record(
                    conn,
                    tenant_id=key.tenant_id,
                    action="key.revoked",
                    actor=_actor(caller),
                    key_id=key.key_id,
                    principal_id=key.principal_id,
                    scopes=sorted(key.scopes),
                )
        # This replica stops at once; the others within their cache TTL.
        self._auth.forget(key.key_id)
        return gateway_pb2.RevokeApiKeyResponse(key_id=key.key_id, revoked=revoked)


def _actor(caller: Principal) -> dict[str, str]:
    """Who acted, for the audit trail."""
    if caller.is_operator:
        return {"kind": "operator"}
    return {"kind": "key", "key_id": caller.key_id, "principal_id": caller.principal_id}
