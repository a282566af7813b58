"""Runs an agent's cap held back (`runs.held_agent`), as a replica's claims keep them: marked as
claims meet them, so that no scan of the claim's passes over them again however many wait (the
claim probes each capped agent with room for its own: `repositories.fair`), and kept reachable
while no cap holds them any more (`settle`).

A claim that picks runs their agent's cap holds back marks those (`hold`) and looks again; the
agent's other claimable runs are marked in the background (a scan of the tenant's claimable
runs, a message probe each), at most once every HOLD_ALL_EVERY_S per agent: a run queued since
is marked by the claim that meets it. Every read of the caps (`caps.CapWatch`, each second), the
replica routes one held run of each agent as its tenant's agents stand now (`settle`): a replica
that never routed the tenant (one restarted) learns the cap, and if no cap holds the agent any
more (lifted, or its runs route elsewhere), the marks are cleared and the claims woken.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.orchestrator.repositories import agent_caps
from services.orchestrator.repositories import leases as lease_repo

log = logging.getLogger(__name__)

# How often, at most, a replica marks every queued run of an agent its cap holds back.
HOLD_ALL_EVERY_S = 60.0
# Agents whose last marking of all is remembered; past this many it starts over.
MAX_AGENTS = 10_000

# (tenant, agent)
Agent = tuple[str, str]


def capped_agents(routes: list[lease_repo.Route]) -> dict[Agent, int]:
    """The capped agents `routes` name ((tenant, agent) to its cap; the least, should two
    routes resolved at different revisions disagree)."""
    capped: dict[Agent, int] = {}
    for route in routes:
        if route.max_running:
            key = (route.tenant_id, route.agent_name)
            capped[key] = min(capped.get(key, route.max_running), route.max_running)
    return capped


class HeldAgents:
    """The marks of the runs agents' caps hold back, as one replica keeps them. `route_keys`
    names the routes (`agent_caps.route_key`) this replica resolved to a tenant's agent;
    `capped_agent` gives the agent a tenant's queued run routes to now, and its cap (0: none),
    or None when it is gone or its routing is broken; `wake` wakes the replica's claims."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        route_keys: Callable[[str, str], Collection[str]],
        capped_agent: Callable[[AsyncConnection, str, str], Awaitable[tuple[str, int] | None]],
        wake: Callable[[], None],
    ) -> None:
        self._engine = engine
        self._route_keys = route_keys
        self._capped_agent = capped_agent
        self._wake = wake
        self._held_all: dict[Agent, float] = {}  # when each agent's runs were last all marked
        self._holding: set[asyncio.Task[None]] = set()

    async def hold(self, conn: AsyncConnection, held: Mapping[Agent, list[str]]) -> None:
        """Mark the runs a claim held back (`held`, by tenant and agent); and, in the background,
        the agents' other claimable runs, if not marked all in the last HOLD_ALL_EVERY_S."""
        now = asyncio.get_running_loop().time()
        for (tenant_id, agent), run_ids in sorted(held.items()):
            await agent_caps.hold_runs(conn, agent, run_ids)
            if now - self._held_all.get((tenant_id, agent), -HOLD_ALL_EVERY_S) < HOLD_ALL_EVERY_S:
                continue
            if len(self._held_all) >= MAX_AGENTS:
                self._held_all.clear()
            self._held_all[(tenant_id, agent)] = now
            task = asyncio.create_task(self._hold_all(tenant_id, agent))
            self._holding.add(task)
            task.add_done_callback(self._holding.discard)

    async def _hold_all(self, tenant_id: str, agent: str) -> None:
        """Mark every claimable run of the tenant's `agent`: those pinned to it, and those of the
        routes this replica resolved to it."""
        try:
            async with self._engine.connect() as conn:
                await agent_caps.hold(conn, tenant_id, agent, self._route_keys(tenant_id, agent))
        except Exception:
            self._held_all.pop((tenant_id, agent), None)
            log.exception("marking the runs %s's cap holds back failed", agent)

    async def done(self) -> None:
        """Wait until the markings under way in the background are done."""
        while self._holding:
            await asyncio.gather(*self._holding)

    async def cap_reached(self, tenant_id: str, run_id: str) -> int | None:
        """The cap of a queued run's agent (`limits.max_running`) when as many of the agent's
        runs run as it allows (the run waits for one to end); None otherwise, or when its
        routing is broken (its claim fails it)."""
        async with self._engine.connect() as conn:
            routed = await self._capped_agent(conn, tenant_id, run_id)
            if routed is None or not routed[1]:
                return None
            agent, cap = routed
            running = await agent_caps.running_of_agent(conn, tenant_id, agent)
        return cap if running >= cap else None

    async def settle(self) -> int:
        """For each agent with runs held for it, one of them routed as its tenant's agents stand
        now; if no cap holds the agent now, the marks of its runs cleared and the claims woken.
        How many runs were cleared."""
        cleared = 0
        async with self._engine.connect() as conn:
            for tenant_id, agent, run_id in await agent_caps.held_pairs(conn):
                routed = await self._capped_agent(conn, tenant_id, run_id)
                if routed is not None and routed[0] == agent and routed[1]:
                    continue  # still capped: the claim probes it within its cap
                cleared += await agent_caps.release(conn, tenant_id, agent)
                self._held_all.pop((tenant_id, agent), None)
        if cleared:
            self._wake()
        return cleared
