"""Render without spending: the first request an attempt of an agent would send for a message
in a new conversation, built by the attempt's own helpers (its tools, its live facts, its
context builder) with no lease, no run and no model call. Its input tokens are the local
estimate compaction uses (`request_tokens`, about four characters of JSON a token), priced at
the agent's input price.

No run means no lease to fence a search of Tether's document store by, so the orchestrator
searches the tenant's documents for the message and sends the matches with the job: the
built-in retriever takes them from there, and any other installed retriever runs as it would.

An agent's MCP servers are listed as a lease lists them (from the same cache), offered after the
other tools as an attempt offers them, when a render can reach them: a server that needs a
credential (a bearer secret, revealed only to a leased run of the agent, or a person's OAuth
connection) is not asked, and the render says `mcp_server_omitted:<name>` for it, as it says
what a listing left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from services.worker.context.builder import ContextBuilder, Document
from services.worker.context.compaction import request_tokens
from services.worker.context.providers import (
    ContextFailed,
    ContextProviders,
    FactRequest,
    RetrievalRequest,
)
from services.worker.interactions import BUILTIN_SPECS
from services.worker.mcp.tools import McpToolbox
from services.worker.tools.registry import ToolRegistry
from tether.domain import AgentConfig, FoundDocument, Origin, Rendered, RenderJob
from tether.pricing import cost_micros

# The output budget of a turn whose agent sets none (the attempt's own default).
DEFAULT_MAX_TOKENS = 1024


def tool_specs(registry: ToolRegistry, allowlist: Sequence[str]) -> list[dict[str, Any]]:
    """The tools an agent's requests carry: the registry's, then the built-in interactions'."""
    return [
        *registry.specs([n for n in allowlist if n not in BUILTIN_SPECS]),
        *(BUILTIN_SPECS[n] for n in allowlist if n in BUILTIN_SPECS),
    ]


def max_tokens(config: AgentConfig) -> int:
    """A turn's output budget."""
    return config.limits.max_tokens_per_turn or DEFAULT_MAX_TOKENS


def turn_max_tokens(config: AgentConfig, used_output: int) -> int:
    """A turn's output budget, clamped to the output tokens the run has left after
    `used_output` (in a run tree, what it has left of its share: the orchestrator lowered its
    ceiling when it leased it)."""
    cap = max_tokens(config)
    ceiling = config.limits.max_output_tokens
    if ceiling:
        cap = min(cap, max(ceiling - used_output, 1))
    return cap


def context_requests(
    config: AgentConfig,
    *,
    tenant_id: str,
    run_id: str,
    origin: Origin,
    input_text: str,
    has_documents: bool,
) -> tuple[FactRequest, RetrievalRequest]:
    """What the live-fact providers and the retriever are asked for one attempt."""
    policy = config.context
    facts = FactRequest(
        tenant_id=tenant_id,
        run_id=run_id,
        source=origin.source,
        channel=origin.channel,
        actor_type=origin.actor_type,
        actor_id=origin.actor_id,
        timezone=policy.timezone,
        now=datetime.now(UTC),
    )
    retrieval = RetrievalRequest(
        tenant_id=tenant_id,
        run_id=run_id,
        query=input_text,
        limit=policy.knowledge_documents,
        max_chars=policy.knowledge_chars,
        has_documents=has_documents,
    )
    return facts, retrieval


class _Found:
    """The document store of a render: the matches the orchestrator sent with the job."""

    def __init__(self, documents: Sequence[FoundDocument]) -> None:
        self._documents = documents

    async def search(self, query: str, *, limit: int, max_chars: int) -> list[Document]:
        """The matches, best first, as a leased search would cut them."""
        return [
            Document(d.document_id, d.title, d.text[:max_chars]) for d in self._documents[:limit]
        ]


async def _mcp_tools(
    config: AgentConfig, registry: ToolRegistry, mcp: McpToolbox | None
) -> tuple[list[dict[str, Any]], list[str]]:
    """The MCP tools an attempt would be offered that a render can list, and what it cannot."""
    if mcp is None or not config.mcp_servers:
        return [], []
    open_ones = tuple(s for s in config.mcp_servers if s.auth == "none")
    closed = [f"mcp_server_omitted:{s.name}" for s in config.mcp_servers if s.auth != "none"]
    taken = {*config.tool_allowlist, *registry.names, *BUILTIN_SPECS}
    leased = await mcp.lease(replace(config, mcp_servers=open_ones), None, taken)
    return list(leased.specs), [*leased.warnings, *closed]


async def render(
    job: RenderJob,
    *,
    registry: ToolRegistry,
    providers: ContextProviders,
    mcp: McpToolbox | None = None,
) -> Rendered:
    """The request `job`'s agent would send first for its message, and its estimate."""
    config = job.config
    facts, retrieval = context_requests(
        config,
        tenant_id=job.tenant_id,
        run_id="",
        origin=Origin(job.source, job.channel, job.actor_type, job.actor_id),
        input_text=job.message,
        has_documents=bool(job.documents),
    )
    try:
        gathered = await providers.gather(config.context, facts, retrieval, _Found(job.documents))
    except ContextFailed as failed:
        return Rendered(job.render_id, {}, error_code=failed.code, error_message=failed.message)
    mcp_specs, warnings = await _mcp_tools(config, registry, mcp)
    builder = ContextBuilder(
        config,
        tools=[*tool_specs(registry, config.tool_allowlist), *mcp_specs],
        summary=None,
        earlier=(),
        facts=gathered.facts,
        documents=gathered.documents,
        input_text=job.message,
    )
    request = builder.request((), model=config.model, max_tokens=max_tokens(config))
    tokens = request_tokens(request)
    cost = cost_micros({"input_tokens": tokens}, config.prices.get(config.model))
    return Rendered(job.render_id, request, tokens, cost, warnings=tuple(warnings))
