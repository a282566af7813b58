"""MCP servers as tool sources for the worker (issue 31, stage 2): the client core the tool path
plugs in. Nothing here records effects, validates input or asks for approval: the caller's tool
path does, with what these answer.

- `McpClients` (one per worker process, `aclose()` at shutdown):
  - `await offer(config.mcp_servers, tokens, taken)` at lease: `(Offer, failures)`; the
    `Offer`'s `tools` (each an `OfferedTool`: `name` server__tool, `server`, `tool`, `spec` for
    the model, `input_schema` to validate against, `risk`) and `warnings` for the run; a server
    that could not be listed is in `failures` by name (an `McpOutcome`; UNAUTHORISED carries
    the `AuthChallenge` a connection pause needs). A warm cache (30 s) costs no round trip.
  - `await call(server, tool, input, idempotency_key, cancellation, token=..., timeout_s=...)`
    per call: an `McpOutcome` (`content` for the model, `is_error`, `failure`, `definite`:
    whether the effects record may close), never an exception but the caller's own
    cancellation.
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
