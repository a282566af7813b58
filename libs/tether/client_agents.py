"""The agents' calls of `tether.client.TetherClient`: a tenant's versioned agents (apply, read,
roll back, make default, render, remove) and the tool catalog they name."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from tether.v1 import gateway_pb2, gateway_pb2_grpc

T = TypeVar("T")


class _Client(Protocol):
    """What the calls take of the client: its stub, its metadata and its retry."""

    stub: gateway_pb2_grpc.GatewayServiceStub
    _metadata: tuple[tuple[str, str], ...]

    async def _idempotent(self, call: Callable[[], Awaitable[T]]) -> T: ...


class AgentCalls:
    """TetherClient's calls about agents (see `tether.client` for which are retried)."""

    async def apply_agent(
        self: _Client, spec: str, *, base_version: int | None = None
    ) -> gateway_pb2.ApplyAgentResponse:
        """Apply an agent document (JSON or YAML text), conditionally on `base_version`.
        Retried through an outage: applying the published document again creates nothing."""
        request = gateway_pb2.ApplyAgentRequest(spec=spec)
        if base_version is not None:
            request.base_version = base_version
        response: gateway_pb2.ApplyAgentResponse = await self._idempotent(
            lambda: self.stub.ApplyAgent(request, metadata=self._metadata)
        )
        return response

    async def get_agent(
        self: _Client, name: str, *, version: int | None = None
    ) -> gateway_pb2.GetAgentResponse:
        """One version of an agent (its published one unless `version` names another)."""
        request = gateway_pb2.GetAgentRequest(name=name)
        if version is not None:
            request.version = version
        response: gateway_pb2.GetAgentResponse = await self._idempotent(
            lambda: self.stub.GetAgent(request, metadata=self._metadata)
        )
        return response

    async def list_agents(self: _Client) -> gateway_pb2.ListAgentsResponse:
        """The tenant's agents by name."""
        response: gateway_pb2.ListAgentsResponse = await self._idempotent(
            lambda: self.stub.ListAgents(gateway_pb2.ListAgentsRequest(), metadata=self._metadata)
        )
        return response

    async def list_tools(self: _Client) -> gateway_pb2.ListToolsResponse:
        """The tool catalog: the tools the workers announced, which an agent may name."""
        response: gateway_pb2.ListToolsResponse = await self._idempotent(
            lambda: self.stub.ListTools(gateway_pb2.ListToolsRequest(), metadata=self._metadata)
        )
        return response

    async def list_agent_versions(
        self: _Client, name: str
    ) -> gateway_pb2.ListAgentVersionsResponse:
        """An agent's versions, oldest first."""
        response: gateway_pb2.ListAgentVersionsResponse = await self._idempotent(
            lambda: self.stub.ListAgentVersions(
                gateway_pb2.ListAgentVersionsRequest(name=name), metadata=self._metadata
            )
        )
        return response

    async def rollback_agent(
        self: _Client, name: str, to_version: int, *, base_version: int | None = None
    ) -> gateway_pb2.RollbackAgentResponse:
        """Publish an earlier version of an agent again, conditionally on `base_version`."""
        request = gateway_pb2.RollbackAgentRequest(name=name, to_version=to_version)
        if base_version is not None:
            request.base_version = base_version
        response: gateway_pb2.RollbackAgentResponse = await self.stub.RollbackAgent(
            request, metadata=self._metadata
        )
        return response

    async def set_default_agent(self: _Client, name: str) -> gateway_pb2.SetDefaultAgentResponse:
        """Make an agent the tenant's default (it takes the runs no route claims)."""
        response: gateway_pb2.SetDefaultAgentResponse = await self.stub.SetDefaultAgent(
            gateway_pb2.SetDefaultAgentRequest(name=name), metadata=self._metadata
        )
        return response

    async def render_agent(
        self: _Client,
        name: str,
        message: str,
        *,
        source: str = "",
        channel: str = "",
        version: int | None = None,
    ) -> gateway_pb2.RenderAgentResponse:
        """The request an agent's worker would send first for `message` (no model call, no
        run). Not retried: UNAVAILABLE says no worker answered, which waiting here would hide."""
        request = gateway_pb2.RenderAgentRequest(
            name=name, message=message, source=source, channel=channel
        )
        if version is not None:
            request.version = version
        response: gateway_pb2.RenderAgentResponse = await self.stub.RenderAgent(
            request, metadata=self._metadata
        )
        return response

    async def remove_agent(self: _Client, name: str) -> gateway_pb2.RemoveAgentResponse:
        """Remove an agent no unfinished run pins."""
        response: gateway_pb2.RemoveAgentResponse = await self.stub.RemoveAgent(
            gateway_pb2.RemoveAgentRequest(name=name), metadata=self._metadata
        )
        return response
