"""The gateway's agent RPCs: a tenant applies, reads, rolls back, defaults and removes its
agents, which the orchestrator owns. Every call authenticates first and names the caller's
tenant (the operator's: the one it names), never the body's."""

from __future__ import annotations

import grpc

from services.gateway.grpc.callers import Callers
from tether.apikeys import Principal
from tether.v1 import gateway_pb2, orchestrator_pb2, orchestrator_pb2_grpc


def _actor(principal: Principal) -> orchestrator_pb2.AgentActor:
    return orchestrator_pb2.AgentActor(
        tenant_id=principal.tenant_id,
        key_id=principal.key_id,
        principal_id=principal.principal_id,
    )


class AgentRpcs:
    """Implements the agents part of tether.v1.GatewayService."""

    def __init__(
        self, callers: Callers, orchestrator: orchestrator_pb2_grpc.OrchestratorServiceStub
    ) -> None:
        self._callers = callers
        self._orchestrator = orchestrator

    async def ApplyAgent(
        self, request: gateway_pb2.ApplyAgentRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ApplyAgentResponse:
        principal = await self._callers.authenticated(context, "ApplyAgent", request)
        forwarded = orchestrator_pb2.PublishAgentRequest(actor=_actor(principal), spec=request.spec)
        if request.HasField("base_version"):
            forwarded.base_version = request.base_version
        applied = await self._orchestrator.PublishAgent(forwarded)
        return gateway_pb2.ApplyAgentResponse(
            name=applied.name, version=applied.version, created=applied.created
        )

    async def GetAgent(
        self, request: gateway_pb2.GetAgentRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GetAgentResponse:
        principal = await self._callers.authenticated(context, "GetAgent", request)
        lookup = orchestrator_pb2.LookupAgentRequest(
            tenant_id=principal.tenant_id, name=request.name
        )
        if request.HasField("version"):
            lookup.version = request.version
        found = await self._orchestrator.LookupAgent(lookup)
        return gateway_pb2.GetAgentResponse(
            agent=found.agent, published_version=found.published_version, default=found.default
        )

    async def ListAgents(
        self, request: gateway_pb2.ListAgentsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListAgentsResponse:
        principal = await self._callers.authenticated(context, "ListAgents", request)
        found = await self._orchestrator.SearchAgents(
            orchestrator_pb2.SearchAgentsRequest(tenant_id=principal.tenant_id)
        )
        return gateway_pb2.ListAgentsResponse(agents=found.agents)

    async def ListAgentVersions(
        self, request: gateway_pb2.ListAgentVersionsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListAgentVersionsResponse:
        principal = await self._callers.authenticated(context, "ListAgentVersions", request)
        found = await self._orchestrator.LookupAgentVersions(
            orchestrator_pb2.LookupAgentVersionsRequest(
                tenant_id=principal.tenant_id, name=request.name
            )
        )
        return gateway_pb2.ListAgentVersionsResponse(versions=found.versions)

    async def RollbackAgent(
        self, request: gateway_pb2.RollbackAgentRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.RollbackAgentResponse:
        principal = await self._callers.authenticated(context, "RollbackAgent", request)
        republish = orchestrator_pb2.RepublishAgentRequest(
            actor=_actor(principal), name=request.name, to_version=request.to_version
        )
        if request.HasField("base_version"):
            republish.base_version = request.base_version
        done = await self._orchestrator.RepublishAgent(republish)
        return gateway_pb2.RollbackAgentResponse(name=done.name, version=done.version)

    async def SetDefaultAgent(
        self, request: gateway_pb2.SetDefaultAgentRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.SetDefaultAgentResponse:
        principal = await self._callers.authenticated(context, "SetDefaultAgent", request)
        done = await self._orchestrator.ChooseDefaultAgent(
            orchestrator_pb2.ChooseDefaultAgentRequest(actor=_actor(principal), name=request.name)
        )
        return gateway_pb2.SetDefaultAgentResponse(name=done.name)

    async def RemoveAgent(
        self, request: gateway_pb2.RemoveAgentRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.RemoveAgentResponse:
        principal = await self._callers.authenticated(context, "RemoveAgent", request)
        done = await self._orchestrator.DeleteAgent(
            orchestrator_pb2.DeleteAgentRequest(actor=_actor(principal), name=request.name)
        )
        return gateway_pb2.RemoveAgentResponse(name=done.name, version=done.version)

    async def ListTools(
        self, request: gateway_pb2.ListToolsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListToolsResponse:
        await self._callers.authenticated(context, "ListTools", request)
        found = await self._orchestrator.ListCatalogTools(
            orchestrator_pb2.ListCatalogToolsRequest()
        )
        return gateway_pb2.ListToolsResponse(tools=found.tools)

    async def RenderAgent(
        self, request: gateway_pb2.RenderAgentRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.RenderAgentResponse:
        principal = await self._callers.authenticated(context, "RenderAgent", request)
        forwarded = orchestrator_pb2.AgentRenderRequest(
            tenant_id=principal.tenant_id,
            name=request.name,
            message=request.message,
            source=request.source,
            channel=request.channel,
            actor_id=principal.principal_id,
        )
        if request.HasField("version"):
            forwarded.version = request.version
        done = await self._orchestrator.AgentRender(forwarded)
        return gateway_pb2.RenderAgentResponse(
            agent=done.agent,
            version=done.version,
            request_json=done.request_json,
            estimated_input_tokens=done.estimated_input_tokens,
            estimated_cost_micros=done.estimated_cost_micros,
            routed_agent=done.routed_agent,
            routed_version=done.routed_version,
            warnings=done.warnings,
        )
