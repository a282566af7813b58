"""The public edge: every RPC of tether.v1.GatewayService, each handed to the handler that serves
its part (runs, interactions, keys, documents, secrets, channels, tenants, streams). A handler
authenticates the call, then forwards it to the service that owns it: tenant and principal always
come from the API key, and errors from internal services are rebuilt as TetherError so the caller
sees the status and message the owner chose.

Both HTTP bridges call these same methods, so a call means the same over gRPC and HTTP.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from services.gateway.grpc.agents import AgentRpcs
from services.gateway.grpc.channels import ChannelRpcs
from services.gateway.grpc.documents import DocumentRpcs
from services.gateway.grpc.interactions import InteractionRpcs
from services.gateway.grpc.keys import KeyRpcs
from services.gateway.grpc.runs import RunRpcs
from services.gateway.grpc.schedules import ScheduleRpcs
from services.gateway.grpc.secrets import SecretRpcs
from services.gateway.grpc.streaming import StreamRpcs
from services.gateway.grpc.tenants import TenantRpcs
from services.gateway.grpc.webhooks import WebhookRpcs
from tether.v1 import gateway_pb2, gateway_pb2_grpc


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    """Implements tether.v1.GatewayService by delegating each RPC to its handler."""

    def __init__(
        self,
        *,
        runs: RunRpcs,
        interactions: InteractionRpcs,
        keys: KeyRpcs,
        documents: DocumentRpcs,
        tenants: TenantRpcs,
        streams: StreamRpcs,
        agents: AgentRpcs,
        secrets: SecretRpcs,
        channels: ChannelRpcs,
        webhooks: WebhookRpcs,
        schedules: ScheduleRpcs,
    ) -> None:
        self._runs = runs
        self._interactions = interactions
        self._keys = keys
        self._documents = documents
        self._tenants = tenants
        self._streams = streams
        self._agents = agents
        self._secrets = secrets
        self._channels = channels
        self._webhooks = webhooks
        self._schedules = schedules

    async def SendMessage(
        self, request: gateway_pb2.SendMessageRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.SendMessageResponse:
        return await self._runs.SendMessage(request, context)

    async def SubmitEvent(
        self, request: gateway_pb2.SubmitEventRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.SubmitEventResponse:
        return await self._runs.SubmitEvent(request, context)

    async def GetRun(
        self, request: gateway_pb2.GetRunRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GetRunResponse:
        return await self._runs.GetRun(request, context)

    async def ListRuns(
        self, request: gateway_pb2.ListRunsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListRunsResponse:
        return await self._runs.ListRuns(request, context)

    async def GetRunAttempts(
        self, request: gateway_pb2.GetRunAttemptsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GetRunAttemptsResponse:
        return await self._runs.GetRunAttempts(request, context)

    async def RetryRun(
        self, request: gateway_pb2.RetryRunRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.RetryRunResponse:
        return await self._runs.RetryRun(request, context)

    async def CancelRun(
        self, request: gateway_pb2.CancelRunRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.CancelRunResponse:
        return await self._runs.CancelRun(request, context)

    async def GetPendingQuestion(
        self, request: gateway_pb2.GetPendingQuestionRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GetPendingQuestionResponse:
        return await self._interactions.GetPendingQuestion(request, context)

    async def AnswerQuestion(
        self, request: gateway_pb2.AnswerQuestionRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.AnswerQuestionResponse:
        return await self._interactions.AnswerQuestion(request, context)

    async def GetPendingApproval(
        self, request: gateway_pb2.GetPendingApprovalRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GetPendingApprovalResponse:
        return await self._interactions.GetPendingApproval(request, context)

    async def DecideApproval(
        self, request: gateway_pb2.DecideApprovalRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.DecideApprovalResponse:
        return await self._interactions.DecideApproval(request, context)

    async def GetPendingConnection(
        self, request: gateway_pb2.GetPendingConnectionRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GetPendingConnectionResponse:
        return await self._interactions.GetPendingConnection(request, context)

    async def CompleteConnection(
        self, request: gateway_pb2.CompleteConnectionRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.CompleteConnectionResponse:
        return await self._interactions.CompleteConnection(request, context)

    async def CreateApiKey(
        self, request: gateway_pb2.CreateApiKeyRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.CreateApiKeyResponse:
        return await self._keys.CreateApiKey(request, context)

    async def RevokeApiKey(
        self, request: gateway_pb2.RevokeApiKeyRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.RevokeApiKeyResponse:
        return await self._keys.RevokeApiKey(request, context)

    async def AddDocument(
        self, request: gateway_pb2.AddDocumentRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.AddDocumentResponse:
        return await self._documents.AddDocument(request, context)

    async def ListDocuments(
        self, request: gateway_pb2.ListDocumentsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListDocumentsResponse:
        return await self._documents.ListDocuments(request, context)

    async def RemoveDocument(
        self, request: gateway_pb2.RemoveDocumentRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.RemoveDocumentResponse:
        return await self._documents.RemoveDocument(request, context)

    async def AddSecret(
        self, request: gateway_pb2.AddSecretRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.AddSecretResponse:
        return await self._secrets.AddSecret(request, context)

    async def ListSecrets(
        self, request: gateway_pb2.ListSecretsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListSecretsResponse:
        return await self._secrets.ListSecrets(request, context)

    async def RemoveSecret(
        self, request: gateway_pb2.RemoveSecretRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.RemoveSecretResponse:
        return await self._secrets.RemoveSecret(request, context)

    async def AddChannel(
        self, request: gateway_pb2.AddChannelRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.AddChannelResponse:
        return await self._channels.AddChannel(request, context)

    async def ListChannels(
        self, request: gateway_pb2.ListChannelsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListChannelsResponse:
        return await self._channels.ListChannels(request, context)

    async def GetChannel(
        self, request: gateway_pb2.GetChannelRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GetChannelResponse:
        return await self._channels.GetChannel(request, context)

    async def RemoveChannel(
        self, request: gateway_pb2.RemoveChannelRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.RemoveChannelResponse:
        return await self._channels.RemoveChannel(request, context)

    async def RotateChannelSecret(
        self, request: gateway_pb2.RotateChannelSecretRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.RotateChannelSecretResponse:
        return await self._channels.RotateChannelSecret(request, context)

    async def AddWebhook(
        self, request: gateway_pb2.AddWebhookRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.AddWebhookResponse:
        return await self._webhooks.AddWebhook(request, context)

    async def ListWebhooks(
        self, request: gateway_pb2.ListWebhooksRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListWebhooksResponse:
        return await self._webhooks.ListWebhooks(request, context)

    async def RemoveWebhook(
        self, request: gateway_pb2.RemoveWebhookRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.RemoveWebhookResponse:
        return await self._webhooks.RemoveWebhook(request, context)

    async def ListWebhookDeliveries(
        self, request: gateway_pb2.ListWebhookDeliveriesRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListWebhookDeliveriesResponse:
        return await self._webhooks.ListWebhookDeliveries(request, context)

    async def RedeliverWebhook(
        self, request: gateway_pb2.RedeliverWebhookRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.RedeliverWebhookResponse:
        return await self._webhooks.RedeliverWebhook(request, context)

    async def ApplyAgent(
        self, request: gateway_pb2.ApplyAgentRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ApplyAgentResponse:
        return await self._agents.ApplyAgent(request, context)

    async def GetAgent(
        self, request: gateway_pb2.GetAgentRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GetAgentResponse:
        return await self._agents.GetAgent(request, context)

    async def ListAgents(
        self, request: gateway_pb2.ListAgentsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListAgentsResponse:
        return await self._agents.ListAgents(request, context)

    async def ListAgentVersions(
        self, request: gateway_pb2.ListAgentVersionsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListAgentVersionsResponse:
        return await self._agents.ListAgentVersions(request, context)

    async def RollbackAgent(
        self, request: gateway_pb2.RollbackAgentRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.RollbackAgentResponse:
        return await self._agents.RollbackAgent(request, context)

    async def SetDefaultAgent(
        self, request: gateway_pb2.SetDefaultAgentRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.SetDefaultAgentResponse:
        return await self._agents.SetDefaultAgent(request, context)

    async def RemoveAgent(
        self, request: gateway_pb2.RemoveAgentRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.RemoveAgentResponse:
        return await self._agents.RemoveAgent(request, context)

    async def ListTools(
        self, request: gateway_pb2.ListToolsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListToolsResponse:
        return await self._agents.ListTools(request, context)

    async def RenderAgent(
        self, request: gateway_pb2.RenderAgentRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.RenderAgentResponse:
        return await self._agents.RenderAgent(request, context)

    async def DeleteTenant(
        self, request: gateway_pb2.DeleteTenantRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.DeleteTenantResponse:
        return await self._tenants.DeleteTenant(request, context)

    async def SetTenant(
        self, request: gateway_pb2.SetTenantRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.SetTenantResponse:
        return await self._tenants.SetTenant(request, context)

    # Each streaming RPC is itself an async generator, the shape grpc.aio serves as a server
    # stream; it relays its handler's items and closes the handler's stream when it ends.

    async def StreamRun(
        self, request: gateway_pb2.StreamRunRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.StreamRunResponse]:
        async with aclosing(self._streams.StreamRun(request, context)) as items:
            async for item in items:
                yield item

    async def StreamConversation(
        self, request: gateway_pb2.StreamConversationRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.StreamConversationResponse]:
        async with aclosing(self._streams.StreamConversation(request, context)) as items:
            async for item in items:
                yield item

    async def StreamRuns(
        self, request: gateway_pb2.StreamRunsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.StreamRunsResponse]:
        async with aclosing(self._streams.StreamRuns(request, context)) as items:
            async for item in items:
                yield item

    async def AddSchedule(
        self, request: gateway_pb2.AddScheduleRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.AddScheduleResponse:
        return await self._schedules.AddSchedule(request, context)

    async def ListSchedules(
        self, request: gateway_pb2.ListSchedulesRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListSchedulesResponse:
        return await self._schedules.ListSchedules(request, context)

    async def PauseSchedule(
        self, request: gateway_pb2.PauseScheduleRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.PauseScheduleResponse:
        return await self._schedules.PauseSchedule(request, context)

    async def ResumeSchedule(
        self, request: gateway_pb2.ResumeScheduleRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ResumeScheduleResponse:
        return await self._schedules.ResumeSchedule(request, context)

    async def RemoveSchedule(
        self, request: gateway_pb2.RemoveScheduleRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.RemoveScheduleResponse:
        return await self._schedules.RemoveSchedule(request, context)
