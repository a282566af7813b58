"""Claims: leasing the oldest claimable run to a worker (a long poll woken per run that may
have become claimable), with the attempt's explicit inputs: routing (cached per tenant), the
run's own parts and its session's history."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.orchestrator import routing
from services.orchestrator.prices import Prices
from services.orchestrator.publisher import Publisher
from services.orchestrator.repositories import leases as lease_repo
from services.orchestrator.repositories import parts as parts_repo
from services.orchestrator.repositories.transitions import NOW, Moved, apply
from tether import states
from tether.domain import AgentConfig, Part, RunError, run_failed
from tether.errors import FailedPrecondition, TetherError

log = logging.getLogger(__name__)

# How long a tenant's routing is reused; a changed agent configuration applies within this.
ROUTING_CACHE_S = 5.0

# The last seq of a run claimed for the first time: run.queued, then run.started.
FRESH_RUN_SEQ = 2


@dataclass(frozen=True)
class Claimed:
    """A leased run with the attempt's explicit inputs: the session's earlier completed runs
    (each input and transcript) and the run's own parts."""

    lease: Moved
    config: AgentConfig
    earlier: list[parts_repo.EarlierRun]
    own: list[Part]

    @property
    def run(self) -> Row[Any]:
        """The run as leased."""
        return self.lease.row


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
        history_runs: int = 50,
    ) -> None:
        self._engine = engine
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._publisher = publisher
        self.wakeups = publisher.wakeups
        self._wakeups = publisher.wakeups
        self._prices = prices
        self._ttl = lease_ttl_s
        self._claim_poll = claim_poll_s
        self._history_runs = history_runs
        self._empty_as_of = -1  # wakeups.generation when the last look that found nothing began
        self._routes: dict[str, tuple[float, AgentConfig]] = {}

    async def claim(self, worker_id: str, wait_s: float) -> Claimed | None:
        """Lease the oldest claimable run, waiting up to `wait_s` for one to appear."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        first = True
        while True:
            ticket = self._wakeups.ticket()  # before looking: a wake-up during the look counts
            claimed = None
            try:
                generation = self._wakeups.generation
                # A new claim that will wait skips the look while nothing woke since one found
                # nothing: its ticket is in line, so the next wake-up (or the poll) is its own.
                if not (first and wait_s > 0 and generation == self._empty_as_of):
                    claimed = await self._claim_once(worker_id)
                    if claimed is None:
                        self._empty_as_of = max(self._empty_as_of, generation)
                first = False
                if claimed is not None or loop.time() >= deadline:
                    taken = None if claimed is None else str(claimed.run.run_id)
                    self._wakeups.leave(ticket, claimed=taken)
                    return claimed
                # Woken by Redis (admission, resumption), locally, or by the replica's poll
                # (poll_claimable) when a wake-up was lost.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ticket, deadline - loop.time())
            except BaseException:
                self._wakeups.leave(ticket, claimed=None)  # failed, or the caller went away
                raise
            self._wakeups.leave(ticket, claimed=None, looking_again=True)

    async def claim_many(self, worker_id: str, n: int) -> list[Claimed]:
        """Lease up to `n` runs now, oldest first (none waited for)."""
        leased: list[Claimed] = []
        while len(leased) < n:
            claimed = await self._claim_once(worker_id)
            if claimed is None:
                break
            leased.append(claimed)
        return leased

    async def poll_claimable(self) -> None:
        """The fallback for wake-ups lost on the way: every claim poll interval, while claims
        wait here, count the claimable runs and wake that many. One cheap query per replica,
        however many claims wait (each polling for itself cost a transaction per claim)."""
        while True:
            await asyncio.sleep(self._claim_poll)
            waiting = self._wakeups.waiting
            if not waiting:
                continue
            try:
                async with self._autocommit.connect() as conn:
                    claimable = await lease_repo.count_claimable(conn, waiting)
            except Exception:
                log.exception("claim poll failed; trying again in %.1f s", self._claim_poll)
                continue
            if claimable:
                self._wakeups.wake([""] * claimable)

    async def _claim_once(self, worker_id: str) -> Claimed | None:
        broken: tuple[str, TetherError] | None = None
        async with self._engine.begin() as conn:
            candidate = await lease_repo.pick_candidate(conn)
            if candidate is None:
                return None
            routing_start = time.perf_counter()
            try:
                config = await self._routing(conn, candidate.tenant_id)
            except TetherError as exc:
                broken = (candidate.run_id, exc)
            else:
                routing_ms = (time.perf_counter() - routing_start) * 1000
                claimed = await self._lease(conn, candidate, worker_id, config, routing_ms)
        if broken is None:
            await self._publisher.publish(claimed.run.run_id, claimed.lease.events)
            return claimed
        # Routing failed after admission: finalise the run rather than leave it queued for
        # every worker to trip over.
        run_id, failure = broken
        log.warning("routing failed for %s: %s", run_id, failure.message)
        await self.fail_unleased(run_id, RunError("routing_failed", failure.message))
        return None

    async def _routing(self, conn: AsyncConnection, tenant_id: str) -> AgentConfig:
        """The tenant's agent configuration, cached briefly (a claim should not re-read it)."""
        now = asyncio.get_running_loop().time()
        cached = self._routes.get(tenant_id)
        if cached is not None and cached[0] > now:
            return cached[1]
        config = routing.resolve(await lease_repo.tenant_agent(conn, tenant_id))
        if len(self._routes) > 10_000:
            self._routes.clear()
        self._routes[tenant_id] = (now + ROUTING_CACHE_S, config)
        return config

    async def _lease(
        self,
        conn: AsyncConnection,
        candidate: Any,
        worker_id: str,
        config: AgentConfig,
        routing_ms: float,
    ) -> Claimed:
        run_id = candidate.run_id
        leased = await lease_repo.lease(
            conn,
            candidate,
            worker_id=worker_id,
            ttl_s=self._ttl,
            config=config.to_json(),
            max_attempts=config.limits.max_attempts,
            routing_ms=routing_ms,
        )
        if leased is None:  # the row is locked by us; a miss means a bug, not a race
            raise FailedPrecondition(f"run {run_id} could not be leased")
        self._prices.remember(run_id, config.prices)
        earlier = await parts_repo.session_history(
            conn, leased.row.session_id, leased.row.created_at, limit_runs=self._history_runs
        )
        # A log of only run.queued and this run.started means nothing was written yet.
        fresh = leased.row.last_seq <= FRESH_RUN_SEQ
        own = [] if fresh else await parts_repo.list_parts(conn, run_id)
        return Claimed(leased, config, earlier, own)

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
            await self._publisher.publish(run_id, moved.events)
            self._publisher.wake_next(moved)
