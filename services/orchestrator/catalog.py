"""The tool catalog: what the workers of every replica announced they run, and the check an
agent's document passes before it is published (every tool it names is in the catalog, every
model it runs has a price).

An empty catalog (no worker ever connected) refuses a document naming tools with
FAILED_PRECONDITION rather than skipping the check: skipping would publish exactly the unchecked
documents a fresh deployment gets, and their runs would then find the tools missing (the worker
offers the model only what it has, so the agent silently loses tools). A document naming no
tools needs no catalog."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from sqlalchemy.ext.asyncio import AsyncEngine

from services.orchestrator.repositories import tools as tool_repo
from tether.agent_spec import AgentSpec, Violation, tool_references, unpriced_models
from tether.agent_spec.violations import refusal
from tether.domain import CatalogedTool, ToolAnnouncement
from tether.errors import FailedPrecondition

log = logging.getLogger(__name__)

SEE_TOOLS_LIST = "see `tether tools list` for the tools the workers announce"


class ToolCatalog:
    """The deployment's tool catalog, on the orchestrator's database."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def announce(self, worker_id: str, tools: Sequence[ToolAnnouncement]) -> None:
        """Record the tools a worker's hello announced."""
        async with self._engine.begin() as conn:
            await tool_repo.announce(conn, worker_id, tools)

    async def listed(self) -> list[CatalogedTool]:
        """Every tool of the catalog, by name."""
        async with self._engine.connect() as conn:
            return await tool_repo.listed(conn)

    async def check(self, spec: AgentSpec) -> None:
        """Refuse `spec` (InvalidArgument listing each unknown tool and unpriced model at its
        pointer) unless the catalog holds every tool it names and every model it runs has a
        price; FailedPrecondition when it names tools and no worker has announced any."""
        violations = list(unpriced_models(spec))
        references = list(tool_references(spec))
        if references:
            async with self._engine.connect() as conn:
                known = await tool_repo.known(conn, {name for _, name in references})
                empty = not known and await tool_repo.is_empty(conn)
            if empty and not violations:
                raise FailedPrecondition(
                    "no worker has announced its tools yet, so the tools this agent names "
                    "cannot be checked: start a worker (it announces its tools when it "
                    f"connects), then apply again; {SEE_TOOLS_LIST}",
                    code="tool_catalog_empty",
                )
            if not empty:
                violations += [
                    Violation(where, f"tool {name!r} is not in the tool catalog; {SEE_TOOLS_LIST}")
                    for where, name in references
                    if name not in known
                ]
        if violations:
            raise refusal(violations)
