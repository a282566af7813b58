"""Routing among a tenant's agents: the agent whose route is most specific for a run's source
and channel (else the tenant's default), and the configuration its published version gives.

A tenant's agents are read once per revision of theirs (one statement) and kept: a claim
resolves a source and channel against them in memory, and the claim's own statement tells
when the revision moved on (`leases.claim`)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncConnection

from services.orchestrator import routing
from services.orchestrator.repositories import agents as agent_repo
from tether.agent_spec import AgentSpec, parse, pick
from tether.domain import AgentConfig
from tether.errors import FailedPrecondition

# Tenants whose agents are kept; past this many the cache starts over.
MAX_TENANTS = 10_000


@dataclass(frozen=True)
class TenantAgents:
    """A tenant's agents at one revision: its default and each agent's published version."""

    revision: int
    default: str | None
    published: dict[str, tuple[int, AgentSpec]]


@dataclass(frozen=True)
class Picked:
    """The agent a run is routed to: its published version's configuration for the run."""

    name: str
    version: int
    config: AgentConfig


def config_for(name: str, spec: AgentSpec, source: str, channel: str) -> AgentConfig:
    """The configuration a version of agent `name` gives a run from `source` on `channel`."""
    return routing.resolve({**spec.overrides(), "agent": name}, source, channel)


class AgentRouting:
    """Routes runs among their tenants' agents, on this replica."""

    def __init__(self) -> None:
        self._tenants: dict[str, TenantAgents] = {}

    async def pick(
        self,
        conn: AsyncConnection,
        tenant_id: str,
        revision: int,
        source: str,
        channel: str,
        *,
        pinned: str = "",
    ) -> Picked | None:
        """The agent of `tenant_id` (whose agents are at `revision`) that takes a run from
        `source` on `channel`: `pinned` when the run's channel connection names one, else the
        most specific route's; None when the tenant has no agents or none takes it (the run is
        then routed with `tenants.agent`). InvalidArgument when the picked version is broken;
        FailedPrecondition when the pinned agent is not the tenant's."""
        if revision == 0 and not pinned:
            return None
        agents = await self._agents(conn, tenant_id, revision)
        if pinned and pinned not in agents.published:
            raise FailedPrecondition(
                f"the run's channel connection routes to agent {pinned!r}, which the tenant "
                "does not have; apply it (tether agents apply) or change the connection's agent",
                details={"agent": pinned},
            )
        name = pinned or pick(
            ((n, spec.routes) for n, (_, spec) in agents.published.items()),
            agents.default,
            source,
            channel,
        )
        if name is None or name not in agents.published:
            return None
        version, spec = agents.published[name]
        return Picked(name, version, config_for(name, spec, source, channel))

    async def _agents(self, conn: AsyncConnection, tenant_id: str, revision: int) -> TenantAgents:
        known = self._tenants.get(tenant_id)
        if known is not None and known.revision >= revision:
            return known
        now, default, versions = await agent_repo.routed_set(conn, tenant_id)
        loaded = TenantAgents(
            now, default, {v.name: (v.version, parse(v.written)) for v in versions}
        )
        if len(self._tenants) >= MAX_TENANTS:
            self._tenants.clear()
        self._tenants[tenant_id] = loaded
        return loaded
