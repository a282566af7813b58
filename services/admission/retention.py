"""Retention of what admission owns (`tether.retention` has the policy and the walk): messages no
run names any more once they are past the tenant's `runs_s`, with the sessions that leaves
empty, and the tombstones of expired claims past `claims_s`; and a deleted tenant's rows.

A claim is never removed while its run exists: the orchestrator's removal of the run turns the
claim into its tombstone (the foreign key's SET NULL), which this sweep removes in its time."""

from __future__ import annotations

import math

from sqlalchemy.ext.asyncio import AsyncEngine

from services.admission import repository as repo
from services.admission import schedule_repository as schedule_repo
from tether.retention import Key, RetentionPolicy, Step, Sweeps
from tether.settings import RetainingSettings


class Retention:
    """Admission's sweeps, on this replica (`sweeps.run()`), and a deleted tenant's rows."""

    def __init__(self, engine: AsyncEngine, settings: RetainingSettings) -> None:
        self._engine = engine
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._batch = settings.retention_batch
        self.sweeps = Sweeps(
            engine,
            {"messages": self._messages_step, "tombstones": self._tombstones_step},
            settings,
        )

    async def _messages_step(
        self, tenant_id: str, policy: RetentionPolicy, after: Key | None, batch: int
    ) -> Step:
        if math.isinf(policy.runs_s):
            return Step(0, 0, 0, None, next_in=math.inf)
        async with self._engine.begin() as conn:
            locked = await repo.lock_expired_messages(conn, tenant_id, policy.runs_s, after, batch)
            removed = await repo.remove_unused_messages(conn, [key for _, key in locked])
        last = locked[-1] if locked else None
        next_in = None
        if len(locked) < batch:
            async with self._autocommit.connect() as conn:
                next_in = await repo.next_message_expiry_in(
                    conn, tenant_id, policy.runs_s, last or after
                )
            # None came after it: one that comes from now expires no sooner than the policy.
            next_in = policy.runs_s if next_in is None else next_in
        return Step(len(locked), removed, len(locked) - removed, last, next_in)

    async def _tombstones_step(
        self, tenant_id: str, policy: RetentionPolicy, after: Key | None, batch: int
    ) -> Step:
        if math.isinf(policy.claims_s):
            return Step(0, 0, 0, None, next_in=math.inf)
        async with self._autocommit.connect() as conn:
            removed = await repo.remove_expired_tombstones(conn, tenant_id, policy.claims_s, batch)
            next_in = None
            if removed < batch:
                # None: no tombstone yet; the orchestrator makes them as it removes runs.
                next_in = await repo.next_tombstone_expiry_in(conn, tenant_id, policy.claims_s)
        return Step(removed, removed, 0, None, next_in)

    async def delete_tenant(self, tenant_id: str) -> tuple[int, bool]:
        """Remove a batch of a deleted tenant's claims, messages, sessions and schedules (its
        runs went first): (how many rows, whether any is left)."""
        async with self._engine.begin() as conn:
            removed = await repo.delete_tenant_rows(conn, tenant_id, self._batch)
            removed += await schedule_repo.delete_tenant_schedules(conn, tenant_id, self._batch)
        async with self._autocommit.connect() as conn:
            left = await repo.tenant_has_rows(conn, tenant_id)
        return removed, left
