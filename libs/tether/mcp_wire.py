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
