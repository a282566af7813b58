"""The service's own rounds, with no caller behind them: pauses past their TTL expire, interactions
their run never parked on are orphaned, and resolutions whose resume did not reach the
orchestrator are delivered again; and a deleted tenant's rows are removed, a batch a call."""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncEngine

from services.interactions import repository as repo
from services.interactions.domain import Orchestrator, Policy, RunFacts
from services.interactions.lifecycle import Lifecycle
from tether.domain import EventType, RunError, interaction_event
from tether.errors import Unavailable
from tether.visibility import Viewer

log = logging.getLogger(__name__)

ORPHANED = "the run never parked on it"

# Rows of a deleted tenant removed per table and call: a bounded transaction each.
DELETE_BATCH = 500


class Upkeep:
    """The expiry, orphan and redelivery sweeps. Main runs each as a round that sleeps until
    its next deadline (`tether.runtime.tasks.rounds`), so an idle service looks seldom: each
    round says when it is next due."""

    def __init__(
        self,
        engine: AsyncEngine,
        orchestrator: Orchestrator,
        lifecycle: Lifecycle,
        policy: Policy,
    ) -> None:
        self._engine = engine
        self._orchestrator = orchestrator
        self._lifecycle = lifecycle
        self._policy = policy

    async def expiry_round(self) -> float | None:
        """Expire what is due; the seconds until the next pending interaction expires."""
        await self.expire_stale()
        async with self._engine.connect() as conn:
            return await repo.next_expiry_in(conn)

    async def orphan_round(self) -> float | None:
        """Check what is due; the seconds until the next unconfirmed one is old enough."""
        await self.sweep_orphans()
        async with self._engine.connect() as conn:
            return await repo.next_binding_check_in(conn, self._policy.orphan_grace_s)

    async def redelivery_round(self) -> float | None:
        """Deliver what is due; the seconds until the next undelivered resolution is."""
        await self.redeliver()
        async with self._engine.connect() as conn:
            return await repo.next_redelivery_in(conn)

    async def expire_stale(self, limit: int = 100) -> int:
        """Close pauses past their TTL. One the run is parked on expires: a consent fails its
        run with a reason (the reaper does not cover a run waiting for a person); an approval
        becomes an expired decision the resumed run claims, so it never loops. One the run was
        never parked on (its worker died first) is orphaned, touching no run; one whose
        storing lease is still live is left for the next sweep (its worker may yet park)."""
        async with self._engine.connect() as conn:
            stale = await repo.expired_pending(conn, limit)
        closed = 0
        for row in stale:
            try:
                run = await self._run_of(row)
            except Unavailable as exc:
                log.warning("expiry sweep deferred: %s", exc.message)
                return closed
            if run.parked_on(row.kind, row.interaction_id):
                async with self._engine.begin() as conn:
                    resolved = await repo.resolve(
                        conn, row.interaction_id, "expired", decision="expired"
                    )
                if resolved is not None:
                    await self._deliver(
                        row.kind, row.tenant_id, row.run_id, row.interaction_id, "expired", row
                    )
            elif run.waiting_interaction_id == row.interaction_id:
                # The run was parked on it and moved on (cancelled): nothing left to wake.
                await self._close(row.interaction_id, "expired", "the run had already finished")
            elif run.lease_held:
                continue
            else:
                await self._close(row.interaction_id, "orphaned", ORPHANED)
            closed += 1
        return closed

    async def sweep_orphans(self, limit: int = 100) -> int:
        """Check each pending interaction once, after a grace: one its run is parked on (or
        was, before it was cancelled) is confirmed and never checked again; one whose storing
        lease is still live is checked again later (its worker may yet park); any other was
        stored by a worker that died before parking, and is orphaned. Questions have no TTL,
        so without this an orphan question would stay pending for ever."""
        async with self._engine.connect() as conn:
            rows = await repo.unconfirmed_pending(conn, self._policy.orphan_grace_s, limit)
        orphaned = 0
        for row in rows:
            try:
                run = await self._run_of(row)
            except Unavailable as exc:
                log.warning("orphan sweep deferred: %s", exc.message)
                break
            if run.waiting_interaction_id == row.interaction_id:
                async with self._engine.begin() as conn:
                    await repo.mark_bound(conn, row.interaction_id)
            elif not run.lease_held:
                await self._close(row.interaction_id, "orphaned", ORPHANED)
                orphaned += 1
        return orphaned

    async def _run_of(self, row: Row[Any]) -> RunFacts:
        """The run of a stored interaction, as this service's own sweeps see it (tenant-wide:
        no caller is involved), and whether the lease that stored it is still live."""
        return await self._orchestrator.visible_run(
            Viewer(row.tenant_id, "", all_runs=True), row.run_id, held_epoch=row.lease_epoch
        )

    async def _close(self, interaction_id: str, status: str, reason: str) -> None:
        async with self._engine.begin() as conn:
            await repo.close_unresolved(conn, interaction_id, status, reason)

    async def redeliver(self, limit: int = 100) -> int:
        """Deliver resolutions whose resume did not reach the orchestrator."""
        async with self._engine.connect() as conn:
            rows = await repo.undelivered(conn, limit)
        for row in rows:
            await self._deliver(
                row.kind, row.tenant_id, row.run_id, row.interaction_id, row.status, row
            )
        return len(rows)

    async def _deliver(
        self,
        kind: str,
        tenant_id: str,
        run_id: str,
        interaction_id: str,
        status: str,
        row: Row[Any],
    ) -> None:
        if kind != "connection" or status != "expired":
            await self._lifecycle.try_resume(
                tenant_id, run_id, kind, interaction_id, row.decision or status
            )
            return
        try:
            await self._orchestrator.expire(
                tenant_id,
                run_id,
                "waiting-for-connection",
                RunError(
                    "connection_expired",
                    f"the {row.provider} consent was not completed within "
                    f"{int(self._policy.consent_ttl_s)} s",
                    retryable=True,
                ),
                interaction_event(
                    EventType.CONNECTION_COMPLETED, interaction_id, outcome="expired"
                ),
                interaction_id,
            )
        except Unavailable as exc:
            log.warning("expiry of %s deferred to the next sweep: %s", run_id, exc.message)
            return
        await self._lifecycle.mark_delivered(interaction_id)

    async def delete_tenant(self, tenant_id: str) -> tuple[int, bool]:
        """Remove a batch of a deleted tenant's grants, interactions and connections: (how
        many rows, whether any is left)."""
        async with self._engine.begin() as conn:
            removed = await repo.delete_tenant_rows(conn, tenant_id, DELETE_BATCH)
        async with self._engine.connect() as conn:
            left = await repo.tenant_has_rows(conn, tenant_id)
        return removed, left
