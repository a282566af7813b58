"""An agent's MCP servers between the domain and the orchestrator's AgentConfig message."""

from __future__ import annotations

from collections.abc import Iterable

from tether.domain import McpServer
from tether.v1 import orchestrator_pb2


def mcp_servers_to_proto(servers: Iterable[McpServer]) -> list[orchestrator_pb2.McpServer]:
    """The McpServer messages of an AgentConfig."""
    return [
        orchestrator_pb2.McpServer(
            name=s.name,
            url=s.url,
            transport=s.transport,
            auth=s.auth,
            bearer_secret=s.bearer_secret,
            tools=list(s.tools),
            risk=dict(s.risk),
        )
        for s in servers
    ]


def mcp_servers_from_proto(
    messages: Iterable[orchestrator_pb2.McpServer],
) -> tuple[McpServer, ...]:
    """The servers an AgentConfig message carries (none from an orchestrator of before)."""
    return tuple(
        McpServer(
            name=m.name,
            url=m.url,
            tools=tuple(m.tools),
            transport=m.transport or "streamable-http",
            auth=m.auth or "none",
            bearer_secret=m.bearer_secret,
            risk=dict(sorted(m.risk.items())),
        )
        for m in messages
    )
