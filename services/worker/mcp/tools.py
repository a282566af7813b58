"""An agent's MCP servers as tools of the run: what the lease offers, and each call through the
one tool path (`tether.tools`).

At lease (`McpToolbox.lease`) the run's servers are listed (a warm cache costs no round trip),
each bearer server's token is fetched from the secret store for this run, each `auth: oauth`
server's is the run principal's connection `mcp:<server>` (without a usable one, or refused with
OAuth metadata, its allowlisted tools are offered connect-first: a call raises an
`McpConnectionGap` and the run pauses `waiting-for-connection`), and each offered
`server__tool` becomes a `tether.tools` tool prepared once per distinct listing: so its input is
validated against the server's schema, refused before any gate in the schema's words; its risk
(annotations, or the agent's override) decides the approval gate; and every call carries its
idempotency key in `_meta` (`McpClients.call`).

A call whose risk is not `read` is an effect of the run (`writes_externally`): recorded under
that key before it fires, its result stored and replayed on a retry. A `read` call is not
recorded, as a built-in read is not: by the server's own `readOnlyHint` (or the agent's word) it
changes nothing, so a retry reads again; it still sends the key the record would have used, so
a server that deduplicates by key answers a re-sent read once too. (Recording reads would cost a
read call two durable writes at the orchestrator and the checkpoint before firing: most of a
light run; `make bench BENCH=tools`, `mcp_run_vs_local_tool_p50`.)

An outcome maps onto the path's three kinds:

- a result, or a tool error / a refusal the server gave (definite): returned, or raised as
  `ToolError`: recorded (for an effect), replayed on retry;
- a call whose outcome cannot be known (timeout, connection lost mid-call, cancelled): an
  `UnsettledCall` coded `tool_outcome_unknown`, which leaves the record open, so a retry (after
  a worker died, or the model calling again) re-sends the SAME key: a server that honours it
  executes once;
- a call that did not run (server down, garbage, a refused target or credential): an
  `UnsettledCall` coded by its `McpFailure`, not recorded either, so a later call can succeed.

What the run is not offered is said on the run: `mcp_tool_omitted:<server__tool>` and
`mcp_server_omitted:<server>` in its completion's warnings (as the context's
`<kind>_omitted:<name>`), the reason in the worker's log.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import jsonschema

from services.worker.mcp.catalog import OfferedTool, canonical
from services.worker.mcp.client import DEFAULT_CALL_TIMEOUT_S, McpClients
from services.worker.mcp.gap import McpConnectionGap, provider
from services.worker.mcp.outcome import AuthChallenge, McpFailure, McpOutcome
from tether.domain import AgentConfig, McpServer
from tether.errors import TetherError
from tether.mcp_wire import offered_name
from tether.tools.base import (
    ConnectionGap,
    RiskCategory,
    ToolContext,
    ToolError,
    ToolOutput,
    ToolSpec,
    UnsettledCall,
)
from tether.tools.decorator import ToolDefinition
from tether.tools.effects import idempotency_key
from tether.tools.path import PreparedTool

log = logging.getLogger(__name__)

OUTCOME_UNKNOWN = "tool_outcome_unknown"
# The path's own deadline is a margin past the client's, so the client's classified timeout
# (the call may have run) answers first.
_PATH_MARGIN_S = 5.0
_RECORDED = {McpFailure.TOOL_ERROR, McpFailure.REJECTED}
MAX_PREPARED = 4096

SecretSource = Callable[[str], Awaitable[str]]
"""The value of the run tenant's secret by name (the worker's `LeasedInteractions.secret`)."""


class TokenSource(Protocol):
    """The run principal's access token for a provider, or `ConnectionGap` (the worker's
    `LeasedInteractions.token`: interactions refreshes an expired one when it can, and one the
    server refused before its expiry when `refused` names it)."""

    def __call__(
        self, provider: str, scopes: Sequence[str], refused: str = ""
    ) -> Awaitable[str]: ...


_CONNECT_FIRST = {"type": "object", "additionalProperties": True}


@dataclass(frozen=True)
class LeasedTools:
    """The MCP part of one attempt's tools: prepared tools by offered name, their Messages API
    params (sorted by name: byte-stable for the prompt cache), and the run's warnings."""

    tools: Mapping[str, PreparedTool]
    specs: tuple[dict[str, Any], ...] = ()
    warnings: tuple[str, ...] = ()


class McpToolbox:
    """Per worker process: its MCP clients and the tools prepared from their listings."""

    def __init__(self, clients: McpClients, *, call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S):
        self.clients = clients
        self._timeout = call_timeout_s
        self._prepared: dict[tuple[str, ...], PreparedTool] = {}

    async def lease(
        self,
        config: AgentConfig,
        secret: SecretSource | None,
        taken: Iterable[str],
        connection: TokenSource | None = None,
    ) -> LeasedTools:
        """What one attempt of `config`'s agent is offered of its MCP servers. An `auth:
        oauth` server is called with the run principal's token for `mcp:<server>`; without a
        usable one (or when the server refuses it with its OAuth metadata) its allowlisted tools
        are offered as connect-first tools, whose call pauses the run for the connection."""
        servers = config.mcp_servers
        if not servers:
            return LeasedTools({})
        taken = set(taken)
        tokens: dict[str, str | None] = {}
        gaps: dict[str, str] = {}
        unusable: list[str] = []
        for server in servers:
            if server.auth == "bearer":
                token = await _bearer(server, secret)
            elif server.auth == "oauth" and connection is not None:
                token, gap = await _connected(server, connection)
                if gap:
                    gaps[server.name] = gap
            else:
                tokens[server.name] = None
                continue
            if token is None and server.auth == "bearer":
                unusable.append(server.name)
            tokens[server.name] = token
        usable = [s for s in servers if s.name not in unusable]
        offer, failures = await self.clients.offer(usable, tokens, taken)
        if connection is not None:
            refreshed = await _refresh_refused(servers, tokens, failures, connection, gaps)
            if refreshed:
                # Listed again with the new tokens (the other servers from the cache).
                offer, failures = await self.clients.offer(usable, tokens, taken)
        for sentence in offer.warnings:
            log.warning("agent %r: %s", config.agent, sentence)
        by_server = {s.name: s for s in servers}
        tools: dict[str, PreparedTool] = {}
        for offered in offer.tools:
            server = by_server[offered.server]
            prepared = self._prepare(offered, server, tokens.get(server.name), connection)
            if prepared is not None:
                tools[offered.name] = prepared
        for name, failure in list(failures.items()):
            server = by_server[name]
            if server.auth != "oauth" or connection is None or not _pausable(failure):
                continue
            assert failure.challenge is not None
            # No token sent: the store's word (absent, or expired past refreshing); one sent
            # and refused: the server's (expired or revoked, or insufficient scope).
            gap = failure.challenge.gap if tokens[name] else gaps.get(name, "absent")
            for tool in server.tools:
                offered_as = offered_name(name, tool)
                if offered_as not in taken and offered_as not in tools:
                    tools[offered_as] = _connect_first(server, offered_as, gap, failure.challenge)
            del failures[name]
        warnings = [f"mcp_server_omitted:{name}" for name in [*unusable, *failures]]
        dropped = set(unusable) | set(failures)
        for server in servers:
            if server.name in dropped:
                continue
            for tool in server.tools:
                name = offered_name(server.name, tool)
                if name not in tools:
                    warnings.append(f"mcp_tool_omitted:{name}")
        specs = tuple(tools[name].spec.to_anthropic() for name in sorted(tools))
        return LeasedTools(tools, specs, tuple(warnings))

    def _prepare(
        self,
        offered: OfferedTool,
        server: McpServer,
        token: str | None,
        connection: TokenSource | None = None,
    ) -> PreparedTool | None:
        """The offered tool as the path runs it; prepared (its schema compiled) once per
        distinct listing, not per lease. None, with a log line, when the path's schema check
        refuses what the metaschema let through, or the risk is not a category."""
        key = (
            offered.name,
            server.url,
            offered.description,
            canonical(offered.input_schema),
            offered.risk,
            # A digest: the token is bound into the handler, never kept as a key.
            hashlib.sha256(token.encode()).hexdigest() if token else "",
        )
        # An OAuth server's tool binds the attempt's own connection source (to refresh a token
        # the server refuses): prepared for that attempt alone, never cached.
        refresh = connection if server.auth == "oauth" and token else None
        cached = self._prepared.get(key) if refresh is None else None
        if cached is not None:
            return cached
        try:
            risk = RiskCategory(offered.risk)
        except ValueError:
            log.warning(
                "MCP tool %s left out: risk %r is not a category", offered.name, offered.risk
            )
            return None
        spec = ToolSpec(
            name=offered.name,
            description=offered.description,
            input_schema=dict(offered.input_schema),
            risk=risk,
            timeout_s=self._timeout + _PATH_MARGIN_S,
            writes_externally=risk is not RiskCategory.READ,
        )
        tool = ToolDefinition(
            spec, _handler(self.clients, server, offered.tool, token, self._timeout, refresh)
        )
        try:
            prepared = PreparedTool(tool)
        except (jsonschema.SchemaError, ValueError) as exc:
            log.warning(
                "MCP tool %s left out: its input schema cannot be enforced (%s)", offered.name, exc
            )
            return None
        if refresh is not None:
            return prepared
        if len(self._prepared) >= MAX_PREPARED:
            self._prepared.clear()
        self._prepared[key] = prepared
        return prepared


async def _bearer(server: McpServer, secret: SecretSource | None) -> str | None:
    if secret is None:
        log.warning("MCP server %r left out: no secret store is wired", server.name)
        return None
    try:
        return await secret(server.bearer_secret)
    except TetherError as exc:
        # The message names the secret, never its value.
        log.warning("MCP server %r left out: its bearer secret: %s", server.name, exc)
        return None


def _refused(failure: McpOutcome | None) -> bool:
    """A token sent and refused with 401 (not a scope it lacks): a refresh may cure it."""
    return (
        failure is not None
        and _pausable(failure)
        and failure.challenge is not None
        and failure.challenge.gap == "expired"
    )


async def _refresh_refused(
    servers: Sequence[McpServer],
    tokens: dict[str, str | None],
    failures: Mapping[str, McpOutcome],
    connection: TokenSource,
    gaps: dict[str, str],
) -> bool:
    """For each `auth: oauth` server that refused the token the store held unexpired (revoked,
    or its clock ahead of ours), the store asked to refresh it: `tokens` updated with each new
    one, `gaps` with each refresh that failed. Whether any token changed."""
    changed = False
    for server in servers:
        token = tokens.get(server.name)
        if server.auth != "oauth" or not token or not _refused(failures.get(server.name)):
            continue
        try:
            fresh = await connection(provider(server.name), (), token)
        except ConnectionGap as gap:
            gaps[server.name] = gap.gap
            continue
        if fresh != token:
            tokens[server.name] = fresh
            changed = True
    return changed


async def _connected(server: McpServer, connection: TokenSource) -> tuple[str | None, str]:
    """(the principal's token for the server, or None and the store's gap)."""
    try:
        return await connection(provider(server.name), ()), ""
    except ConnectionGap as gap:
        return None, gap.gap


def _pausable(failure: McpOutcome) -> bool:
    """A refusal the person can fix by connecting: a 401/403 with an authorisation server."""
    return (
        failure.failure is McpFailure.UNAUTHORISED
        and failure.challenge is not None
        and bool(failure.challenge.authorization_endpoint)
        and bool(failure.challenge.token_endpoint)
    )


def _connect_first(
    server: McpServer, name: str, gap: str, challenge: AuthChallenge
) -> PreparedTool:
    """A tool of a server the person has not connected (yet): calling it pauses the run for
    the connection; once resumed, the attempt is offered the server's real tool."""

    async def call(ctx: ToolContext, input: dict[str, Any]) -> ToolOutput:
        raise McpConnectionGap(server=server.name, gap=gap, challenge=challenge)

    spec = ToolSpec(
        name=name,
        description=(
            f"A tool of the MCP server {server.name!r}, which needs the user to connect their "
            "account first: calling it asks them to, and the call runs once they have."
        ),
        input_schema=dict(_CONNECT_FIRST),
        # It only pauses: no effect, no gate (the real tool's risk gates the real call).
        risk=RiskCategory.READ,
    )
    return PreparedTool(ToolDefinition(spec, call))


def _handler(
    clients: McpClients,
    server: McpServer,
    tool: str,
    token: str | None,
    timeout_s: float,
    refresh: TokenSource | None = None,
) -> Callable[[ToolContext, dict[str, Any]], Awaitable[ToolOutput]]:
    async def call(ctx: ToolContext, input: dict[str, Any]) -> ToolOutput:
        # A read is not an effect (no key from the path): it sends the key the record would.
        key = ctx.idempotency_key or idempotency_key(ctx.tenant_id, ctx.root_run_id, name, input)
        outcome = await clients.call(
            server, tool, input, key, ctx.cancelled, token=token, timeout_s=timeout_s
        )
        if refresh is not None and token and _refused(outcome):
            # Refused unseen (401: nothing ran): once more with a refreshed token, same key.
            try:
                fresh = await refresh(provider(server.name), (), token)
            except ConnectionGap:
                fresh = token  # not refreshable: the pause below says so
            if fresh != token:
                outcome = await clients.call(
                    server, tool, input, key, ctx.cancelled, token=fresh, timeout_s=timeout_s
                )
        if server.auth == "oauth" and _pausable(outcome):
            assert outcome.challenge is not None
            # Refused mid-run (expired, revoked, or a scope this tool needs): nothing ran.
            raise McpConnectionGap(
                server=server.name, gap=outcome.challenge.gap, challenge=outcome.challenge
            )
        return settle(outcome, name)

    name = offered_name(server.name, tool)
    return call


def settle(outcome: McpOutcome, name: str) -> ToolOutput:
    """An MCP outcome as the path takes it: a result returned, a definite tool error raised as
    `ToolError` (recorded), anything else as `UnsettledCall` (the record stays open)."""
    if outcome.failure is None:
        return ToolOutput(
            outcome.content, data=None if outcome.data is None else dict(outcome.data)
        )
    if not outcome.definite:
        raise UnsettledCall(
            f"{outcome.content} ({outcome.failure.value}). Whether {name} ran is unknown: "
            "calling it again with the same input re-sends the same idempotency key, so a "
            "server that honours it will not run it twice; otherwise check before retrying.",
            OUTCOME_UNKNOWN,
        )
    if outcome.failure in _RECORDED:
        raise ToolError(outcome.content)
    raise UnsettledCall(f"{outcome.content} ({name} did not run)", outcome.failure.value)


def allowlisted(servers: Sequence[McpServer]) -> list[str]:
    """Every `server__tool` name the agent's servers allowlist."""
    return [offered_name(s.name, t) for s in servers for t in s.tools]
