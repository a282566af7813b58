"""Render without spending: the request an agent's attempt would send first for a message, built
on a worker (the orchestrator loads none of the worker's tools or context providers) and pushed
on a Work stream with no lease, so no model is called and no run exists. The configuration is
resolved as a claim resolves it, and the answer names the agent the tenant's routes pick for the
source and channel, whichever agent was rendered."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from services.orchestrator.agent_routing import config_for
from services.orchestrator.agents import Agents
from services.orchestrator.knowledge import Knowledge
from services.orchestrator.repositories import agents as agent_repo
from services.orchestrator.work import Work
from tether.agent_spec import parse, pick
from tether.domain import FoundDocument, RenderJob
from tether.errors import FailedPrecondition, InvalidArgument


@dataclass(frozen=True, slots=True)
class AgentRender:
    """A rendered request, its estimate, and the routes' pick."""

    agent: str
    version: int
    request: dict[str, Any]
    estimated_input_tokens: int
    estimated_cost_micros: int
    routed_agent: str
    routed_version: int
    warnings: tuple[str, ...] = ()


class AgentRenders:
    """Renders of a tenant's agents, by the workers on this replica's Work streams."""

    def __init__(
        self,
        engine: AsyncEngine,
        agents: Agents,
        knowledge: Knowledge,
        work: Work,
        timeout_s: float,
    ) -> None:
        self._engine = engine
        self._agents = agents
        self._knowledge = knowledge
        self._work = work
        self._timeout_s = timeout_s

    async def render(
        self,
        tenant_id: str,
        name: str,
        message: str,
        *,
        version: int | None = None,
        source: str = "",
        channel: str = "",
        actor_id: str = "",
    ) -> AgentRender:
        """The first request of agent `name` (its published version unless `version`) for
        `message` from `source` on `channel`. NotFound for an absent agent (another tenant's
        too), InvalidArgument without a message, Unavailable when no worker answers,
        FailedPrecondition when a required context provider fails on the worker."""
        if not message.strip():
            raise InvalidArgument(
                "message is required: the text to render", details={"field": "message"}
            )
        shown = await self._agents.show(tenant_id, name, version)
        chosen = shown.version
        async with self._engine.connect() as conn:
            _, default, published = await agent_repo.routed_set(conn, tenant_id)
        routed_name = pick(
            ((v.name, parse(v.written).routes) for v in published), default, source, channel
        )
        routed = {v.name: v.version for v in published}
        config = config_for(chosen.name, parse(chosen.written), source, channel)
        policy = config.context
        found = (
            await self._knowledge.search(
                tenant_id,
                message,
                limit=policy.knowledge_documents,
                max_chars=policy.knowledge_chars,
            )
            if policy.retriever
            else []
        )
        documents = tuple(FoundDocument(m.document_id, m.title, m.text) for m in found)
        # The caller stands in for the actor, as the user a run of theirs would have.
        job = RenderJob(0, tenant_id, config, message, source, channel, "user", actor_id, documents)
        rendered = await self._work.render(job, self._timeout_s)
        if rendered.error_code:
            raise FailedPrecondition(rendered.error_message, code=rendered.error_code)
        return AgentRender(
            chosen.name,
            chosen.version,
            rendered.request,
            rendered.estimated_input_tokens,
            rendered.estimated_cost_micros,
            routed_name if routed_name in routed else "",
            routed.get(routed_name or "", 0),
            rendered.warnings,
        )
