"""What one MCP call (or listing) comes to: a result for the model, or a classified failure the
model can act on, never an exception. `definite` tells the effects record whether the server's
answer is known: a result, a tool error or a refusal close the record; a call that may or may not
have run (a timeout, a connection lost mid-call, a cancel) leaves it open, so a retry fires again
under the same idempotency key."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import mcp.types as mcp_types


class McpFailure(StrEnum):
    """Why an MCP call failed; stable codes."""

    SERVER_DOWN = "mcp_server_down"
    """No connection (refused, unreachable), or the server answered 5xx: try later."""
    REFUSED_TARGET = "mcp_refused_target"
    """The URL resolves to an address the deployment's outbound-target policy forbids."""
    TIMEOUT = "mcp_timeout"
    """No answer in time; the call may have run."""
    CONNECTION_LOST = "mcp_connection_lost"
    """The connection broke after the request left; the call may have run."""
    PROTOCOL = "mcp_protocol_error"
    """The server answered something that is not MCP (garbage, a wrong shape)."""
    REJECTED = "mcp_rejected"
    """The server refused the request with a JSON-RPC error (unknown tool, invalid params)."""
    TOOL_ERROR = "mcp_tool_error"
    """The tool ran and reported an error (`isError: true`)."""
    UNAUTHORISED = "mcp_unauthorised"
    """401 or 403: a connection gap; `McpOutcome.challenge` says what the server wants."""
    CANCELLED = "mcp_cancelled"
    """The caller's cancellation stopped the call; the server was sent notifications/cancelled."""


@dataclass(frozen=True, slots=True)
class AuthChallenge:
    """What a server that answered 401/403 asked for. `gap` is "absent" (no token was sent),
    "expired" (the token sent was refused: expired or revoked) or "insufficient_scope" (403);
    the metadata fields come from its protected-resource metadata (RFC 9728) and its
    authorisation server's metadata (RFC 8414), empty when it publishes none."""

    status: int
    gap: str
    error: str = ""
    scopes: tuple[str, ...] = ()
    resource_metadata_url: str = ""
    resource: str = ""
    authorization_servers: tuple[str, ...] = ()
    issuer: str = ""
    authorization_endpoint: str = ""
    token_endpoint: str = ""
    registration_endpoint: str = ""
    code_challenge_methods: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class McpOutcome:
    """One call's outcome. `content` is what the model reads (the result, or the failure in a
    sentence it can act on); `data` the structured result when the server gave one."""

    content: str
    is_error: bool = False
    failure: McpFailure | None = None
    definite: bool = True
    data: Mapping[str, Any] | None = None
    challenge: AuthChallenge | None = None
    detail: str = field(default="", repr=False)


def failed(
    failure: McpFailure,
    message: str,
    *,
    definite: bool,
    challenge: AuthChallenge | None = None,
    detail: str = "",
) -> McpOutcome:
    """A failed outcome."""
    return McpOutcome(
        message,
        is_error=True,
        failure=failure,
        definite=definite,
        challenge=challenge,
        detail=detail,
    )


def from_result(result: mcp_types.CallToolResult) -> McpOutcome:
    """A `tools/call` result as the model reads it: its content blocks as text (a block that is
    not text named by its kind), or, with no content, its structured content as JSON."""
    text = "\n".join(_block_text(block) for block in result.content)
    data = result.structured_content
    if not text and data is not None:
        text = json.dumps(data, sort_keys=True, ensure_ascii=False)
    if result.is_error:
        return McpOutcome(
            text or "the tool reported an error and said nothing more",
            is_error=True,
            failure=McpFailure.TOOL_ERROR,
            data=data,
        )
    return McpOutcome(text, data=data)


def _block_text(block: Any) -> str:
    if isinstance(block, mcp_types.TextContent):
        return block.text
    if isinstance(block, mcp_types.EmbeddedResource):
        resource = block.resource
        if isinstance(resource, mcp_types.TextResourceContents):
            return resource.text
        return f"[resource {resource.uri} ({resource.mime_type or 'binary'})]"
    if isinstance(block, mcp_types.ResourceLink):
        return f"[resource link {block.uri}]"
    if isinstance(block, mcp_types.ImageContent | mcp_types.AudioContent):
        kind = "image" if isinstance(block, mcp_types.ImageContent) else "audio"
        return f"[{kind} {block.mime_type}, {len(block.data) * 3 // 4} bytes, not shown]"
    return f"[{getattr(block, 'type', 'unknown')} content, not shown]"


def joined(values: Sequence[str]) -> str:
    """`values` as a short English list."""
    return ", ".join(values) if values else "none"
