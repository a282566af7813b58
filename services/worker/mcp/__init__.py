"""MCP servers as tool sources for the worker (issue 31, stage 2): the client core the tool path
plugs in. Nothing here records effects or asks for approval: the caller's tool path does, with
what these answer.

- `McpClients` (one per worker process): `offer(...)` at lease, the tools a run is offered and
  why any were left out; `call(...)` per tool call, an `McpOutcome`, never an exception;
  `aclose()` at shutdown.
- `catalog`: naming (`server__tool`), risk from annotations, the schema and collision rules.
- `oauth`: a 401's challenge and metadata, and the PKCE authorisation URL.
"""

from __future__ import annotations

from services.worker.mcp.catalog import (
    DEFAULT_RISK,
    MAX_SCHEMA_BYTES,
    ListedTool,
    Offer,
    OfferedTool,
    risk_of,
)
from services.worker.mcp.client import Listing, McpClients
from services.worker.mcp.oauth import authorization_url, pkce_pair
from services.worker.mcp.outcome import AuthChallenge, McpFailure, McpOutcome

__all__ = [
    "DEFAULT_RISK",
    "MAX_SCHEMA_BYTES",
    "AuthChallenge",
    "ListedTool",
    "Listing",
    "McpClients",
    "McpFailure",
    "McpOutcome",
    "Offer",
    "OfferedTool",
    "authorization_url",
    "pkce_pair",
    "risk_of",
]
