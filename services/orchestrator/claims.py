"""Claims: leasing the oldest claimable runs to a worker, a batch in one statement (or one run in
a long poll woken per run that may have become claimable), with each attempt's explicit inputs:
routing (resolved once per tenant agent, source and channel, cached; pinned on the run by its
first lease), the run's own parts and its session's history (read, for the whole batch in one
more statement, only when some run has any)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.orchestrator import budgets, routing
from services.orchestrator.agent_routing import AgentRouting
from services.orchestrator.caps import CapWatch
from services.orchestrator.held_agents import HeldAgents, capped_agents
from services.orchestrator.prices import Prices
from services.orchestrator.publisher import Publisher
from services.orchestrator.repositories import agent_caps, fair, history
from services.orchestrator.repositories import leases as lease_repo
from services.orchestrator.repositories.picked import Leased, Picked, Unrouted
from services.orchestrator.repositories.transitions import NOW, Moved, apply, numbered
from tether import states
from tether.domain import (
    AGENT_VERSION,
    AgentConfig,
    EndedChild,
    Origin,
    Part,
    Run,
    RunError,
    run_failed,
    run_started,
)
from tether.domain.channels import PIN_SEPARATOR
from tether.errors import TetherError

log = logging.getLogger(__name__)

# The last seq of a run claimed for the first time: run.queued, then run.started.
FRESH_RUN_SEQ = 2

# Tenants whose routing is kept; past this many the cache starts over.
MAX_ROUTES = 10_000


@dataclass(frozen=True)
class Routing:
    """A tenant's routing for a source and channel, resolved at its agents' `revision` (0: it
    has none) by one of its agents' published `version`s (None: from `tenants.agent`, which
    `agent` then holds as it stood), and the name it is stored under (`routings`: the digest
    of its stored form)."""

    agent: dict[str, Any] | None
    config: AgentConfig
    revision: int = 0
    version: int | None = None

    @functools.cached_property
    def stored(self) -> dict[str, Any]:
        """The stored form: the configuration, and the version of the agent it came from (a
        release before agents reads past the extra key)."""
        stored = self.config.to_json()
        if self.version is not None:
            stored[AGENT_VERSION] = self.version
        return stored

    @functools.cached_property
    def routing_id(self) -> str:
        """Its name: the first 128 bits of the digest of its canonical JSON, in hex."""
        canonical = json.dumps(self.stored, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:32]


# What a worker holds of a session's history: its newest earlier run's created_at, and its
# summary (run id, part index).
Known = tuple[datetime | None, tuple[str, int] | None]

# Where a run came from, as routing sees it: its tenant, source and channel.
RouteKey = tuple[str, str, str]


# The origin of a claim that names none (Origin is frozen: one instance serves every claim).
_NOWHERE = Origin()


@dataclass(frozen=True)
class Claimed:
    """A leased run with the attempt's explicit inputs: where it came from, the session's
    earlier completed runs (each input and transcript) and the run's own parts, and whether its
    tenant has knowledge documents to retrieve from."""

    lease: Moved
    config: AgentConfig
    earlier: list[history.EarlierRun]
    own: list[Part]
    # When it was last moved before this lease (the database's clock), and what resolving its
    # routing took in this claim: its claim's latency, for telemetry.
    queued_at: datetime
    routing_ms: float | None
    origin: Origin = _NOWHERE
    has_documents: bool = False
    summary: Part | None = None
    last_turn: history.LastTurn = history.NO_TURN
    # The latest summary's place, also when its part was not read (the worker holds it).
    summary_mark: history.SummaryMark | None = None
    # Its children that have ended (a run queued again once they had).
    ended_children: tuple[EndedChild, ...] = ()

    @property
    def run(self) -> Run:
        """The run as leased."""
        return self.lease.run


class Claims:
    """Leases runs to workers on this replica."""

    def __init__(
        self,
        engine: AsyncEngine,
        publisher: Publisher,
        prices: Prices,
        *,
        lease_ttl_s: float,
        claim_poll_s: float,
        claim_poll_hinted_s: float,
        history_runs: int = history.HISTORY_RUNS,
        claim_engine: AsyncEngine | None = None,
    ) -> None:
        self._engine = engine
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        # The claim's own pool, when the replica gives it one (planned with `CLAIM_PLANNER`).
        self._claiming = claim_engine or engine
        self._claiming_autocommit = self._claiming.execution_options(isolation_level="AUTOCOMMIT")
        self._publisher = publisher
        # The waiting claims' line (the lease dispatcher waits in it too).
        self.wakeups = publisher.wakeups
        self._prices = prices
        self._ttl = lease_ttl_s
        self._claim_poll = claim_poll_s
        self._claim_poll_hinted = claim_poll_hinted_s
        self._history_runs = history_runs
        self._empty_as_of = -1  # wakeups.generation when the last look that found nothing began
        self._routes: dict[RouteKey, Routing] = {}
        # Routing decisions this replica stored (`routings`), so a claim stores each once.
        self._stored_routings: set[str] = set()
        # Decisions by name, for the runs that lease again with the one they were pinned to.
        self._pinned: dict[str, AgentConfig] = {}
        self._agents = AgentRouting()
        # The runs agents' caps held back, marked as the claims meet them.
        self.held = HeldAgents(
            self._autocommit,
            route_keys=self._route_keys,
            capped_agent=self._capped_agent,
            wake=lambda: self.wakeups.wake_all(),
        )
        # A change of caps (or of the runs flagged by them) may leave runs claimable.
        self.caps = CapWatch(
            self._autocommit, changed=lambda: self.wakeups.wake_all(), also=self.held.settle
        )
        # Tenants one of whose agents this replica routed to with a cap (agent_caps): a run of
        # theirs that ends wakes a claim, as one of a capped tenant does.
        self._agent_capped: set[str] = set()
        publisher.capped = lambda: self.caps.capped | self._agent_capped

    async def claim(self, worker_id: str, wait_s: float) -> Claimed | None:
        """Lease the oldest claimable run, waiting up to `wait_s` for one to appear."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        first = True
        while True:
            ticket = self.wakeups.ticket()  # before looking: a wake-up during the look counts
            claimed = None
            try:
                generation = self.wakeups.generation
                # A new claim that will wait skips the look while nothing woke since one found
                # nothing: its ticket is in line, so the next wake-up (or the poll) is its own.
                if not (first and wait_s > 0 and generation == self._empty_as_of):
                    claimed = await self._claim_once(worker_id)
                    if claimed is None:
                        self._empty_as_of = max(self._empty_as_of, generation)
                first = False
                if claimed is not None or loop.time() >= deadline:
                    taken = None if claimed is None else str(claimed.run.run_id)
                    self.wakeups.leave(ticket, claimed=taken)
                    return claimed
                # Woken by Redis (admission, resumption), locally, or by the replica's poll
                # (poll_claimable) when a wake-up was lost.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ticket, deadline - loop.time())
            except BaseException:
                self.wakeups.leave(ticket, claimed=None)  # failed, or the caller went away
                raise
            self.wakeups.leave(ticket, claimed=None, looking_again=True)

    async def poll_claimable(self) -> None:
        """The fallback for wake-ups lost on the way: while claims wait here, count the
        claimable runs and wake that many. One cheap query per replica, however many claims
        wait (each polling for itself cost a transaction per claim); every claim poll interval
        while wake-ups are not heard through Redis, and seldom while they are (then only one
        its sender failed to publish is missed: a lost subscription wakes every claim itself)."""
        while True:
            hinted = self.wakeups.hinted
            await asyncio.sleep(self._claim_poll_hinted if hinted else self._claim_poll)
            waiting = self.wakeups.waiting
            if not waiting:
                continue
            try:
                async with self._autocommit.connect() as conn:
                    claimable = await lease_repo.count_claimable(conn, waiting)
            except Exception:
                log.exception("claim poll failed; trying again in %.1f s", self._claim_poll)
                continue
            if claimable:
                self.wakeups.wake([""] * claimable)

    @contextlib.asynccontextmanager
    async def _on_claims_pool(self, conn: AsyncConnection) -> AsyncIterator[AsyncConnection]:
        """Where the claim statement and the history read after it run: the claims' pool
        (`CLAIM_PLANNER`), or `conn` itself when there is none (never a second connection of
        the pool `conn` holds one of); the rest plan as every other statement does, on `conn`."""
        if self._claiming is self._engine:
            yield conn
            return
        async with self._claiming_autocommit.connect() as claiming:
            yield claiming

    async def _look(self, conn: AsyncConnection, params: dict[str, Any]) -> Picked:
        """One claim statement. While some tenant has a cap, in a transaction that locks the
        capped tenants first (`fair.lock_capped`), and while some route names a capped agent,
        those agents too (`agent_caps.lock_agents`): then the claim's own snapshot, taken after
        the locks, counts every lease committed before, and no other replica leases for them
        until it commits."""
        capped = self.caps.capped
        agents = capped_agents(params["routes"])
        if not capped and not agents:
            async with self._on_claims_pool(conn) as claiming:
                return await lease_repo.claim(claiming, lease_repo.claim_params(**params))
        async with self._claiming.connect() as held, held.begin():
            # Tenants first, then agents, each in order: every claim locks in one order.
            locked = await fair.lock_capped(held, capped) if capped else []
            if agents:
                await agent_caps.lock_agents(held, agents)
            return await lease_repo.claim(
                held, lease_repo.claim_params(**params, locked=locked, locked_agents=agents)
            )

    async def _claim_once(self, worker_id: str) -> Claimed | None:
        claimed = await self.claim_many(worker_id, 1)
        return claimed[0] if claimed else None

    @property
    def history_runs(self) -> int:
        """How many of its session's earlier completed runs a lease's history holds at most."""
        return self._history_runs

    async def claim_many(
        self, worker_id: str, n: int, held: Callable[[str], Known] | None = None
    ) -> list[Claimed]:
        """Lease up to `n` claimable runs to `worker_id` now (oldest session heads first; never
        waits): one statement, and one more for the history and parts of those that have any.
        `held` says, by session id, what the worker holds of a session's history already (its
        newest earlier run's created_at, its summary): that much is not read again.

        A tenant this replica has no routing for yet (or whose agent changed) costs one more
        claim statement, once: its runs come back unleased with the agent to resolve."""
        if n <= 0:
            return []
        leased: list[Leased] = []
        broken: list[tuple[str, RunError]] = []
        routed_now: dict[RouteKey, float] = {}
        async with self._autocommit.connect() as conn:
            # Each look leases, or resolves the routing its unleased runs lacked (or fails them)
            # so that the next look leases them; a third is for an agent changed in between.
            for _ in range(3):
                routes = dict(self._routes)
                unstored = {
                    r.routing_id: r.stored
                    for r in routes.values()
                    if r.routing_id not in self._stored_routings
                }
                look = await self._look(
                    conn,
                    {
                        "worker_id": worker_id,
                        "limit": n - len(leased),
                        "ttl_s": self._ttl,
                        "routes": [self._route(k, r, routed_now) for k, r in routes.items()],
                        "stored": unstored,
                    },
                )
                self._stored_routings.update(unstored)
                for route in routes.values():
                    self._pinned[route.routing_id] = route.config
                leased.extend(look.leased)
                # Runs a cap held back took slots others could have had: they (and, soon, their
                # agents' other queued runs) are marked held, out of every scan, and the next
                # look fills those slots.
                await self.held.hold(conn, look.held)
                if not (look.unrouted or look.held) or len(leased) >= n:
                    break
                broken.extend(await self._resolve(conn, look.unrouted, routed_now))
            # The history on the claims' pool too: planning it costs more than running it (about
            # 1 ms against 0.3 at a 50-run history), and there it runs on its one generic plan
            # from a connection's first lease, where the other pool planned it afresh for each
            # connection's first five (every lease of a fresh replica's first fifty).
            async with self._on_claims_pool(conn) as claiming:
                inputs = await history.attempt_inputs(
                    claiming,
                    [self._wanted(one, held) for one in leased],
                    limit_runs=self._history_runs,
                )
            configs = await self._configs(conn, leased)
            trees = await budgets.leased_configs(
                conn, [(one.run, configs[one.routing_id]) for one in leased]
            )
        claimed = []
        for one in leased:
            run = one.run
            config = trees.configs.get(run.run_id) or configs[one.routing_id]
            started = run_started(run.attempt, worker_id, run.lease_epoch)
            found = inputs[run.run_id]
            origin = Origin(one.source, run.channel, one.actor_type, one.actor_id, one.reply)
            claimed.append(
                Claimed(
                    Moved(run, numbered(run.last_seq, [started])),
                    config,
                    found.earlier,
                    found.own,
                    one.queued_at,
                    one.routing_ms,
                    origin,
                    one.has_documents,
                    found.summary,
                    found.last_turn,
                    found.summary_mark,
                    trees.ended.get(run.run_id, ()),
                )
            )
            self._prices.remember(run.run_id, config.prices)
        for lease in claimed:
            await self._publisher.publish(lease.run, lease.lease.events)
        # Routing failed after admission: finalise the run rather than leave it queued for
        # every worker to trip over.
        for run_id, error in broken:
            log.warning("routing failed for %s: %s", run_id, error.message)
            await self.fail_unleased(run_id, error)
        return claimed

    async def _configs(self, conn: Any, leased: list[Leased]) -> dict[str, AgentConfig]:
        """The routing each leased run runs with, by routing id: the one its first lease pinned,
        read back from `routings` when this replica does not know it (a run leased again after
        its tenant's agent changed, or first leased by another replica)."""
        missing = {one.routing_id for one in leased} - set(self._pinned)
        if missing:
            if len(self._pinned) + len(missing) > MAX_ROUTES:
                self._pinned = {r.routing_id: r.config for r in self._routes.values()}
            for routing_id, stored in (await lease_repo.routings_of(conn, missing)).items():
                self._pinned[routing_id] = AgentConfig.from_json(stored)
        return {one.routing_id: self._pinned[one.routing_id] for one in leased}

    @staticmethod
    def _route(
        key: RouteKey, routing: Routing, routed_now: dict[RouteKey, float]
    ) -> lease_repo.Route:
        tenant_id, source, channel = key
        return lease_repo.Route(
            tenant_id,
            source,
            channel,
            routing.agent,
            routing.revision,
            routing.routing_id,
            routing.config.limits.max_attempts,
            routed_now.get(key, 0.0),
            routing.config.agent,
            routing.config.max_running,
        )

    async def _resolve(
        self, conn: Any, unrouted: list[Unrouted], routed_now: dict[RouteKey, float]
    ) -> list[tuple[str, RunError]]:
        """Resolve the routing of the tenants, sources and channels of runs the claim could not
        lease; the runs of a tenant whose configuration is broken, with why."""
        broken = []
        for run in unrouted:
            key = (run.tenant_id, run.source, run.channel)
            agent = dict(run.agent)
            if self._known(key, agent, run.revision) is not None:
                continue  # resolved for a run before this one
            started = time.perf_counter()
            try:
                routed = await self._routing_for(conn, key, agent, run.revision)
            except TetherError as exc:
                broken.append((run.run_id, RunError("routing_failed", exc.message)))
                continue
            if len(self._routes) >= MAX_ROUTES:
                self._routes.clear()
                self._stored_routings.clear()
            self._routes[key] = routed
            if routed.config.max_running:
                self._agent_capped.add(run.tenant_id)
            routed_now[key] = (time.perf_counter() - started) * 1000
        return broken

    def _route_keys(self, tenant_id: str, agent: str) -> list[str]:
        """The routes this replica resolved to the tenant's `agent` (`agent_caps.route_key`)."""
        return [
            agent_caps.route_key(source, channel)
            for (tenant, source, channel), routed in self._routes.items()
            if tenant == tenant_id and routed.config.agent == agent
        ]

    async def _capped_agent(
        self, conn: AsyncConnection, tenant_id: str, run_id: str
    ) -> tuple[str, int] | None:
        """The agent a queued run runs as (the one its first lease pinned, else its route's as
        its tenant's agents stand now: resolved again when this replica's route is not current,
        and kept, so the claim leases within it) and that agent's cap (0: none); None when the
        run is gone or its routing broken."""
        facts = await lease_repo.route_facts(conn, run_id)
        if facts is None:
            return None
        key = (tenant_id, facts.source, facts.channel)
        if self._known(key, facts.agent, facts.revision) is None:
            unrouted = Unrouted(
                run_id, tenant_id, facts.source, facts.channel, facts.agent, facts.revision
            )
            await self._resolve(conn, [unrouted], {})
        routed = self._known(key, facts.agent, facts.revision)
        if routed is None:
            return None
        name = facts.agent_name or routed.config.agent
        return name, routed.config.max_running if routed.config.agent == name else 0

    def _known(self, key: RouteKey, agent: dict[str, Any], revision: int) -> Routing | None:
        """The route this replica resolved for `key`, while it still holds: at the tenant's
        agents' `revision`, and, resolved from `tenants.agent`, while that is `agent`."""
        known = self._routes.get(key)
        if (
            known is not None
            and known.revision == revision
            and (known.agent is None or known.agent == agent)
        ):
            return known
        return None

    async def _routing_for(
        self, conn: Any, key: RouteKey, agent: dict[str, Any], revision: int
    ) -> Routing:
        """Resolve the routing of a tenant's runs from a source on a channel (`key`), its
        agents at `revision` and its `tenants.agent` `agent`; TetherError when it is broken."""
        tenant_id, source, routed_channel = key
        # A channel connection naming an agent pins its runs to it (`slack/support`).
        channel, _, pinned = routed_channel.partition(PIN_SEPARATOR)
        picked = await self._agents.pick(conn, tenant_id, revision, source, channel, pinned=pinned)
        if picked is None:
            return Routing(agent, routing.resolve(agent, source, channel), revision)
        return Routing(None, picked.config, revision, picked.version)

    @staticmethod
    def _wanted(leased: Leased, held: Callable[[str], Known] | None) -> history.Wanted:
        run = leased.run
        # A log of only run.queued and this run.started means nothing was written yet.
        fresh = run.last_seq <= FRESH_RUN_SEQ
        after, summary = (None, None) if held is None else held(run.session_id)
        return history.Wanted(
            run.run_id,
            run.session_id,
            run.created_at,
            leased.has_history,
            not fresh,
            after,
            summary,
        )

    async def fail_unleased(self, run_id: str, error: RunError) -> None:
        """Fail a queued run that cannot even start (routing or context broken)."""
        async with self._engine.begin() as conn:
            moved = await apply(
                conn,
                states.FAIL_UNLEASED,
                run_id,
                events=[run_failed(error)],
                values={"error": error.to_row(), "finished_at": NOW},
            )
        if moved is not None:
            await self._publisher.publish(moved.run, moved.events)
            self._publisher.wake_next(moved)
