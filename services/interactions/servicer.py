"""Interactions' gRPC edge."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import json_format

from services.interactions.approvals import Approvals
from services.interactions.channels_edge import ChannelRpcs
from services.interactions.connections import Connections
from services.interactions.domain import QuestionSpec
from services.interactions.mcp_oauth import McpEndpoints
from services.interactions.questions import Questions
from services.interactions.secret_store import SecretInfo, SecretStore
from services.interactions.upkeep import Upkeep
from services.interactions.webhook_secrets_edge import WebhookSecretRpcs
from tether.convert import timestamp
from tether.errors import InvalidArgument, NotFound
from tether.v1 import interactions_pb2, interactions_pb2_grpc
from tether.visibility import Viewer

_GAPS = {
    "absent": interactions_pb2.CONNECTION_GAP_ABSENT,
    "expired": interactions_pb2.CONNECTION_GAP_EXPIRED,
    "insufficient_scope": interactions_pb2.CONNECTION_GAP_INSUFFICIENT_SCOPE,
}
_GAP_NAMES = {v: k for k, v in _GAPS.items()}


def _spec(spec: interactions_pb2.QuestionSpec) -> QuestionSpec:
    return QuestionSpec(spec.key, spec.prompt, tuple(spec.options), spec.multiple, spec.allow_other)


def _spec_proto(data: dict[str, Any]) -> interactions_pb2.QuestionSpec:
    spec = QuestionSpec.from_json(data)
    return interactions_pb2.QuestionSpec(
        key=spec.key,
        prompt=spec.prompt,
        options=list(spec.options),
        multiple=spec.multiple,
        allow_other=spec.allow_other,
    )


def _secret_info(info: SecretInfo) -> interactions_pb2.SecretInfo:
    return interactions_pb2.SecretInfo(
        name=info.name, last_four=info.last_four, created_at=timestamp(info.created_at)
    )


def pending_question(row: Any) -> interactions_pb2.PendingQuestion:
    """The read model of an open question."""
    return interactions_pb2.PendingQuestion(
        interaction_id=row.interaction_id,
        run_id=row.run_id,
        questions=[_spec_proto(q) for q in row.questions],
        created_at=timestamp(row.created_at),
    )


def pending_approval(row: Any, allowed: list[str]) -> interactions_pb2.PendingApproval:
    """The read model of an open approval: what runs is what is shown."""
    approval = interactions_pb2.PendingApproval(
        interaction_id=row.interaction_id,
        run_id=row.run_id,
        tool_name=row.tool_name,
        summary=row.summary or "",
        risk_category=row.risk_category or "",
        estimated_cost_micros=row.estimated_cost_micros or 0,
        expires_at=timestamp(row.expires_at),
        allowed_decisions=allowed,
    )
    json_format.ParseDict(row.input or {}, approval.input)
    return approval


def pending_connection(row: Any) -> interactions_pb2.PendingConnection:
    """The read model of an open consent offer."""
    return interactions_pb2.PendingConnection(
        interaction_id=row.interaction_id,
        run_id=row.run_id,
        provider=row.provider,
        gap=_GAPS.get(row.gap, interactions_pb2.CONNECTION_GAP_UNSPECIFIED),
        login_url=row.login_url,
        expires_at=timestamp(row.expires_at),
        scopes=row.scopes or [],
    )


class InteractionsServicer(interactions_pb2_grpc.InteractionsServiceServicer):
    """Implements tether.v1.InteractionsService."""

    def __init__(
        self,
        questions: Questions,
        approvals: Approvals,
        connections: Connections,
        upkeep: Upkeep,
        secrets: SecretStore,
        channels: ChannelRpcs,
        webhook_secrets: WebhookSecretRpcs,
    ) -> None:
        self._questions = questions
        self._approvals = approvals
        self._connections = connections
        self._upkeep = upkeep
        self._secrets = secrets
        self._channels = channels
        self._webhook_secrets = webhook_secrets

    async def AddSecret(
        self,
        request: interactions_pb2.InteractionsServiceAddSecretRequest,
        context: grpc.aio.ServicerContext,
    ) -> interactions_pb2.InteractionsServiceAddSecretResponse:
        if not request.tenant_id:
            raise InvalidArgument("tenant_id is required")
        info = await self._secrets.add(
            request.tenant_id, request.principal_id, request.name, request.value
        )
        return interactions_pb2.InteractionsServiceAddSecretResponse(secret=_secret_info(info))

    async def ListSecrets(
        self,
        request: interactions_pb2.InteractionsServiceListSecretsRequest,
        context: grpc.aio.ServicerContext,
    ) -> interactions_pb2.InteractionsServiceListSecretsResponse:
        if not request.tenant_id:
            raise InvalidArgument("tenant_id is required")
        listed = await self._secrets.list(request.tenant_id)
        return interactions_pb2.InteractionsServiceListSecretsResponse(
            secrets=[_secret_info(i) for i in listed]
        )

    async def RemoveSecret(
        self,
        request: interactions_pb2.InteractionsServiceRemoveSecretRequest,
        context: grpc.aio.ServicerContext,
    ) -> interactions_pb2.InteractionsServiceRemoveSecretResponse:
        if not request.tenant_id:
            raise InvalidArgument("tenant_id is required")
        await self._secrets.remove(request.tenant_id, request.name)
        return interactions_pb2.InteractionsServiceRemoveSecretResponse()

    async def AddChannel(
        self,
        request: interactions_pb2.InteractionsServiceAddChannelRequest,
        context: grpc.aio.ServicerContext,
    ) -> interactions_pb2.InteractionsServiceAddChannelResponse:
        return await self._channels.AddChannel(request, context)

    async def ListChannels(
        self,
        request: interactions_pb2.InteractionsServiceListChannelsRequest,
        context: grpc.aio.ServicerContext,
    ) -> interactions_pb2.InteractionsServiceListChannelsResponse:
        return await self._channels.ListChannels(request, context)

    async def GetChannel(
        self,
        request: interactions_pb2.InteractionsServiceGetChannelRequest,
        context: grpc.aio.ServicerContext,
    ) -> interactions_pb2.InteractionsServiceGetChannelResponse:
        return await self._channels.GetChannel(request, context)

    async def RemoveChannel(
        self,
        request: interactions_pb2.InteractionsServiceRemoveChannelRequest,
        context: grpc.aio.ServicerContext,
    ) -> interactions_pb2.InteractionsServiceRemoveChannelResponse:
        return await self._channels.RemoveChannel(request, context)

    async def RotateChannelSecret(
        self,
        request: interactions_pb2.InteractionsServiceRotateChannelSecretRequest,
        context: grpc.aio.ServicerContext,
    ) -> interactions_pb2.InteractionsServiceRotateChannelSecretResponse:
        return await self._channels.RotateChannelSecret(request, context)

    async def LookupChannelVerification(
        self,
        request: interactions_pb2.LookupChannelVerificationRequest,
        context: grpc.aio.ServicerContext,
    ) -> interactions_pb2.LookupChannelVerificationResponse:
        return await self._channels.LookupChannelVerification(request, context)

    async def SealWebhookSecret(
        self, request: interactions_pb2.SealWebhookSecretRequest, context: grpc.aio.ServicerContext
    ) -> interactions_pb2.SealWebhookSecretResponse:
        return await self._webhook_secrets.SealWebhookSecret(request, context)

    async def OpenWebhookSecret(
        self, request: interactions_pb2.OpenWebhookSecretRequest, context: grpc.aio.ServicerContext
    ) -> interactions_pb2.OpenWebhookSecretResponse:
        return await self._webhook_secrets.OpenWebhookSecret(request, context)

    async def DiscardWebhookSecret(
        self,
        request: interactions_pb2.DiscardWebhookSecretRequest,
        context: grpc.aio.ServicerContext,
    ) -> interactions_pb2.DiscardWebhookSecretResponse:
        return await self._webhook_secrets.DiscardWebhookSecret(request, context)

    async def LookupChannelDelivery(
        self,
        request: interactions_pb2.LookupChannelDeliveryRequest,
        context: grpc.aio.ServicerContext,
    ) -> interactions_pb2.LookupChannelDeliveryResponse:
        return await self._channels.LookupChannelDelivery(request, context)

    async def DeleteTenantInteractions(
        self,
        request: interactions_pb2.DeleteTenantInteractionsRequest,
        context: grpc.aio.ServicerContext,
    ) -> interactions_pb2.DeleteTenantInteractionsResponse:
        if not request.tenant_id:
            raise InvalidArgument("tenant_id is required")
        removed, remaining = await self._upkeep.delete_tenant(request.tenant_id)
        return interactions_pb2.DeleteTenantInteractionsResponse(
            removed=removed, remaining=remaining
        )

    async def AskQuestions(
        self, request: interactions_pb2.AskQuestionsRequest, context: grpc.aio.ServicerContext
    ) -> interactions_pb2.AskQuestionsResponse:
        interaction_id = await self._questions.ask(
            request.run_id,
            request.epoch,
            request.tool_call_id,
            [_spec(q) for q in request.questions],
        )
        return interactions_pb2.AskQuestionsResponse(interaction_id=interaction_id)

    async def RecordAnswers(
        self, request: interactions_pb2.RecordAnswersRequest, context: grpc.aio.ServicerContext
    ) -> interactions_pb2.RecordAnswersResponse:
        interaction_id, resumed = await self._questions.answer(
            Viewer(request.tenant_id, request.principal_id, request.all_runs),
            request.run_id,
            {k: list(v.values) for k, v in request.answers.items()},
        )
        return interactions_pb2.RecordAnswersResponse(
            interaction_id=interaction_id, resumed=resumed
        )

    async def FindPendingQuestion(
        self,
        request: interactions_pb2.FindPendingQuestionRequest,
        context: grpc.aio.ServicerContext,
    ) -> interactions_pb2.FindPendingQuestionResponse:
        row = await self._questions.pending_question(
            Viewer(request.tenant_id, request.principal_id, request.all_runs), request.run_id
        )
        response = interactions_pb2.FindPendingQuestionResponse()
        if row is not None:
            response.question.CopyFrom(pending_question(row))
        return response

    async def FindAnsweredQuestions(
        self,
        request: interactions_pb2.FindAnsweredQuestionsRequest,
        context: grpc.aio.ServicerContext,
    ) -> interactions_pb2.FindAnsweredQuestionsResponse:
        rows = await self._questions.answered(request.run_id, request.epoch)
        return interactions_pb2.FindAnsweredQuestionsResponse(
            answered=[
                interactions_pb2.AnsweredQuestion(
                    interaction_id=r.interaction_id,
                    tool_call_id=r.tool_call_id,
                    questions=[_spec_proto(q) for q in r.questions],
                    answers={
                        k: interactions_pb2.QuestionAnswer(values=v)
                        for k, v in (r.answers or {}).items()
                    },
                )
                for r in rows
            ]
        )

    async def CheckGrant(
        self, request: interactions_pb2.CheckGrantRequest, context: grpc.aio.ServicerContext
    ) -> interactions_pb2.CheckGrantResponse:
        grant = await self._approvals.check_grant(
            request.run_id, request.epoch, request.tool_name, request.risk_category
        )
        return interactions_pb2.CheckGrantResponse(allowed=grant is not None, grant_id=grant or "")

    async def RequestApproval(
        self,
        request: interactions_pb2.RequestApprovalRequest,
        context: grpc.aio.ServicerContext,
    ) -> interactions_pb2.RequestApprovalResponse:
        interaction_id = await self._approvals.request_approval(
            request.run_id,
            request.epoch,
            tool_call_id=request.tool_call_id,
            tool_name=request.tool_name,
            input=json_format.MessageToDict(request.input),
            risk_category=request.risk_category,
            summary=request.summary,
            estimated_cost_micros=request.estimated_cost_micros,
            idempotency_key=request.idempotency_key,
        )
        return interactions_pb2.RequestApprovalResponse(interaction_id=interaction_id)

    async def RecordDecision(
        self, request: interactions_pb2.RecordDecisionRequest, context: grpc.aio.ServicerContext
    ) -> interactions_pb2.RecordDecisionResponse:
        interaction_id, resumed, grant = await self._approvals.decide(
            Viewer(request.tenant_id, request.principal_id, request.all_runs),
            request.run_id,
            request.decision,
            request.always_scope,
        )
        return interactions_pb2.RecordDecisionResponse(
            interaction_id=interaction_id, resumed=resumed, grant_id=grant
        )

    async def ClaimApproval(
        self, request: interactions_pb2.ClaimApprovalRequest, context: grpc.aio.ServicerContext
    ) -> interactions_pb2.ClaimApprovalResponse:
        if not request.tool_name:
            raise InvalidArgument("tool_name is required: a claim authorises one tool")
        if not request.tool_call_id:
            raise InvalidArgument("tool_call_id is required: a claim authorises one tool call")
        row = await self._approvals.claim_approval(
            request.run_id, request.epoch, request.tool_name, request.tool_call_id
        )
        if row is None:
            return interactions_pb2.ClaimApprovalResponse(claimed=False)
        response = interactions_pb2.ClaimApprovalResponse(
            claimed=True,
            interaction_id=row.interaction_id,
            decision=row.decision or "expired",
            tool_call_id=row.tool_call_id,
            tool_name=row.tool_name,
            idempotency_key=row.idempotency_key or "",
        )
        json_format.ParseDict(row.input or {}, response.input)
        return response

    async def FindPendingApproval(
        self,
        request: interactions_pb2.FindPendingApprovalRequest,
        context: grpc.aio.ServicerContext,
    ) -> interactions_pb2.FindPendingApprovalResponse:
        row = await self._approvals.pending_approval(
            Viewer(request.tenant_id, request.principal_id, request.all_runs), request.run_id
        )
        response = interactions_pb2.FindPendingApprovalResponse()
        if row is not None:
            allowed = await self._approvals.allowed_decisions(request.tenant_id, row)
            response.approval.CopyFrom(pending_approval(row, allowed))
        return response

    async def RequestConnection(
        self,
        request: interactions_pb2.RequestConnectionRequest,
        context: grpc.aio.ServicerContext,
    ) -> interactions_pb2.RequestConnectionResponse:
        gap = _GAP_NAMES.get(request.gap)
        if gap is None:
            raise InvalidArgument("gap is required")
        offer = await self._connections.request_connection(
            request.run_id,
            request.epoch,
            tool_call_id=request.tool_call_id,
            provider=request.provider,
            gap=gap,
            scopes=list(request.scopes),
            mcp=McpEndpoints(
                request.mcp.authorization_endpoint,
                request.mcp.token_endpoint,
                request.mcp.resource,
            )
            if request.HasField("mcp")
            else None,
        )
        if offer is None:
            return interactions_pb2.RequestConnectionResponse()
        return interactions_pb2.RequestConnectionResponse(
            interaction_id=offer[0], login_url=offer[1]
        )

    async def ConfirmConnection(
        self,
        request: interactions_pb2.ConfirmConnectionRequest,
        context: grpc.aio.ServicerContext,
    ) -> interactions_pb2.ConfirmConnectionResponse:
        resumed = await self._connections.complete_connection(
            Viewer(request.tenant_id, request.principal_id, request.all_runs),
            request.run_id,
            request.state,
            request.code,
        )
        return interactions_pb2.ConfirmConnectionResponse(resumed=resumed)

    async def FindPendingConnection(
        self,
        request: interactions_pb2.FindPendingConnectionRequest,
        context: grpc.aio.ServicerContext,
    ) -> interactions_pb2.FindPendingConnectionResponse:
        row = await self._connections.pending_connection(
            Viewer(request.tenant_id, request.principal_id, request.all_runs), request.run_id
        )
        response = interactions_pb2.FindPendingConnectionResponse()
        if row is not None:
            response.connection.CopyFrom(pending_connection(row))
        return response

    async def ResolveConnection(
        self,
        request: interactions_pb2.ResolveConnectionRequest,
        context: grpc.aio.ServicerContext,
    ) -> interactions_pb2.ResolveConnectionResponse:
        gap, token, ref = await self._connections.resolve_connection(
            request.run_id,
            request.epoch,
            request.provider,
            list(request.scopes),
            refused_sha256=request.refused_token_sha256,
        )
        return interactions_pb2.ResolveConnectionResponse(
            gap=_GAPS[gap] if gap else interactions_pb2.CONNECTION_GAP_UNSPECIFIED,
            access_token=token,
            credential_ref=ref,
        )

    async def RevealRunSecret(
        self,
        request: interactions_pb2.RevealRunSecretRequest,
        context: grpc.aio.ServicerContext,
    ) -> interactions_pb2.RevealRunSecretResponse:
        # Worker-only (POWERS), and only under the run's live lease: the tenant is the leased
        # run's, never the caller's say, and the secret one its pinned agent names (a lease is a
        # grant to run that agent, not a key to the tenant's store); any other is NOT_FOUND,
        # exactly like an absent one. The value is neither logged nor traced here.
        if not request.name:
            raise InvalidArgument("name is required")
        run = await self._connections.leased_run(request.run_id, request.epoch)
        if request.name not in run.secret_names:
            raise NotFound(f"no secret named {request.name!r}")
        value = await self._secrets.reveal(run.tenant_id, request.name)
        return interactions_pb2.RevealRunSecretResponse(value=value)
