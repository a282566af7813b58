"""Retention of the run aggregate: terminal runs past their tenant's policy are removed with all
that is theirs, and whole tool outputs sooner (`tether.retention` has the policy and the walk),
in bounded batches off the hot path; and a deleted tenant's runs, whatever their status."""

from __future__ import annotations

import math

from sqlalchemy.ext.asyncio import AsyncEngine

from services.orchestrator.repositories import agents as agent_repo
from services.orchestrator.repositories import channel_statuses as statuses_repo
from services.orchestrator.repositories import documents as documents_repo
from services.orchestrator.repositories import fair
from services.orchestrator.repositories import retention as repo
from services.orchestrator.repositories import webhooks as webhooks_repo
from tether.retention import Key, RetentionPolicy, Step, Sweeps
from tether.settings import RetainingSettings


class Retention:
    """The orchestrator's sweeps, on this replica (`sweeps.run()`), and a deleted tenant's
    runs."""

    def __init__(self, engine: AsyncEngine, settings: RetainingSettings) -> None:
        self._engine = engine
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._batch = settings.retention_batch
        self.sweeps = Sweeps(
            engine,
            {"runs": self._runs_step, "tool outputs": self._tool_outputs_step},
            settings,
        )

    async def _runs_step(
        self, tenant_id: str, policy: RetentionPolicy, after: Key | None, batch: int
    ) -> Step:
        if math.isinf(policy.runs_s):
            return Step(0, 0, 0, None, next_in=math.inf)
        async with self._engine.begin() as conn:
            locked = await repo.lock_expired_runs(conn, tenant_id, policy.runs_s, after, batch)
            removed = await repo.remove_expired_runs(
                conn, [run_id for _, run_id in locked], policy.runs_s, policy.conversations_s
            )
        last = locked[-1] if locked else None
        next_in = None
        if len(locked) < batch:
            async with self._autocommit.connect() as conn:
                next_in = await repo.next_expiry_in(conn, tenant_id, policy.runs_s, last or after)
            # None finished after it: one finishing from now expires no sooner than the policy.
            next_in = policy.runs_s if next_in is None else next_in
        return Step(len(locked), len(removed), len(locked) - len(removed), last, next_in)

    async def _tool_outputs_step(
        self, tenant_id: str, policy: RetentionPolicy, after: Key | None, batch: int
    ) -> Step:
        keep_s = min(policy.tool_outputs_s, policy.runs_s)
        if math.isinf(keep_s):
            return Step(0, 0, 0, None, next_in=math.inf)
        async with self._autocommit.connect() as conn:
            examined, removed, last = await repo.remove_tool_outputs(
                conn, tenant_id, keep_s, after, batch
            )
            next_in = None
            if examined < batch:
                next_in = await repo.next_expiry_in(conn, tenant_id, keep_s, last or after)
        next_in = keep_s if next_in is None and examined < batch else next_in
        return Step(examined, removed, 0, last, next_in)

    async def delete_tenant(self, tenant_id: str) -> tuple[int, bool]:
        """Remove a batch of a deleted tenant's runs, then of its knowledge documents, then its
        agents, its webhook subscriptions, then what its channels' providers reported, then its
        finish tag in fair leases: (how many, whether any is left)."""
        async with self._engine.begin() as conn:
            removed = await repo.delete_tenant_runs(conn, tenant_id, self._batch)
            if removed < self._batch:
                removed += await documents_repo.remove_tenant_documents(
                    conn, tenant_id, self._batch - removed
                )
            if removed < self._batch:
                # All at once: a tenant's agents are documents people write (thousands at
                # most, one statement), and going last no run is still pinned to one.
                removed += await agent_repo.delete_tenant(conn, tenant_id)
                # A tenant has a handful of subscriptions; their logs go with them.
                removed += await webhooks_repo.delete_tenant_subscriptions(conn, tenant_id)
            if removed < self._batch:
                removed += await statuses_repo.delete_tenant(conn, tenant_id, self._batch - removed)
            if removed < self._batch:
                # Its finish tag in fair leases: bookkeeping, not data, so not counted.
                await fair.delete_tenant(conn, tenant_id)
        async with self._autocommit.connect() as conn:
            left = await repo.tenant_has_runs(conn, tenant_id)
            left = left or await documents_repo.tenant_has_documents(conn, tenant_id)
            left = left or await agent_repo.tenant_has_agents(conn, tenant_id)
            left = left or await statuses_repo.tenant_has_statuses(conn, tenant_id)
            left = left or await webhooks_repo.tenant_has_subscriptions(conn, tenant_id)
            left = left or await fair.tenant_has_tags(conn, tenant_id)
        return removed, left
