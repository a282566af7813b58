"""What Tether and an MCP server agree on beyond the protocol: the `_meta` key a tool call's
idempotency key travels under. The worker's MCP client sends it and the local stand-in
(tether.testing.mcp_server) honours it, both from here, so neither can drift from the other.

A server that honours it executes a call once per key: a second `tools/call` with the same key
answers the stored result without running the tool again. A server that does not know it
ignores it (the protocol lets `_meta` carry keys a receiver does not understand)."""

from __future__ import annotations

from typing import Final

IDEMPOTENCY_KEY_META: Final = "tether/idempotency_key"
"""`params._meta[IDEMPOTENCY_KEY_META]` of a `tools/call`: the call's idempotency key."""

SEPARATOR: Final = "__"
"""Between a server's name and its tool's in the name the model sees: `orders__lookup_order`.
A server's name never holds it (the agent schema refuses one that does), so the first one
splits an offered name back into its server and tool."""

MAX_OFFERED_NAME: Final = 64
"""The longest tool name the Messages API takes (`^[a-zA-Z0-9_-]{1,64}$`)."""


def offered_name(server: str, tool: str) -> str:
    """The name a server's tool is offered to the model under."""
    return f"{server}{SEPARATOR}{tool}"


def split_offered_name(name: str) -> tuple[str, str] | None:
    """(server, tool) of an offered name, or None when `name` is not one."""
    server, sep, tool = name.partition(SEPARATOR)
    return (server, tool) if sep and server and tool else None
