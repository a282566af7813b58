"""The one pause-and-resume lifecycle that questions, approvals and connections share.

Each kind is stored (pending), resolved once by a person (a guarded update), and resumes its
run to queued once through the orchestrator (a guarded transition there). A resolution whose
resume did not get through is delivered by the sweep; the orchestrator's guard keeps it once.

An interaction is inert until its run is parked on it: the orchestrator's fenced park binds the
run to one interaction id, and only that one can be answered, decided, completed, expired or
claimed (the orchestrator says which, and its resume and expiry apply only to it). One stored
by a worker that died before parking stays unbound and is swept as orphaned.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.interactions import repository as repo
from services.interactions.domain import RESOLUTIONS, Orchestrator, RunFacts
from tether.errors import Unavailable
from tether.ids import new_id

log = logging.getLogger(__name__)


class Lifecycle:
    """What every kind shares: storing a pending interaction under a live lease, finding the one
    its run is parked on, and resuming the run once a resolution is stored."""

    def __init__(self, engine: AsyncEngine, orchestrator: Orchestrator) -> None:
        self._engine = engine
        self._orchestrator = orchestrator
        # Set when a resume did not reach the orchestrator: the redelivery round runs at once.
        self.undelivered = asyncio.Event()

    async def store(
        self,
        run_id: str,
        epoch: int,
        kind: str,
        tool_call_id: str,
        *,
        run: RunFacts | None = None,
        **fields: Any,
    ) -> str:
        """Store a pending interaction of a run whose lease `epoch` is live (`run`, when the
        caller has already looked it up by that lease); returns its id."""
        interaction_id = new_id("int")
        # Checked before the insert, not in its transaction: the lease may end in between, and
        # that is harmless, for an interaction is inert until the orchestrator's fenced park
        # (checked by the same lease) binds the run to it. One whose park never lands stays
        # unbound, can be neither resolved nor claimed, and is swept as orphaned.
        if run is None:
            run = await self._orchestrator.leased_run(run_id, epoch)
        async with self._engine.begin() as conn:
            await repo.insert_interaction(
                conn,
                interaction_id=interaction_id,
                tenant_id=run.tenant_id,
                run_id=run_id,
                session_id=run.session_id,
                # Who may complete a consent: the run's owner, whose account it connects.
                principal_id=run.owner_principal_id,
                kind=kind,
                tool_call_id=tool_call_id,
                lease_epoch=epoch,
                **fields,
            )
        return interaction_id

    @staticmethod
    async def open(
        conn: AsyncConnection, run_id: str, kind: str, bound: str | None, *, lock: bool = False
    ) -> Row[Any] | None:
        """The pending interaction the run is parked on; None when it waits on no `kind`."""
        if bound is None:
            return None
        return await repo.bound_interaction(conn, run_id, bound, kind, lock=lock)

    async def try_resume(
        self, tenant_id: str, run_id: str, kind: str, interaction_id: str, decision: str = ""
    ) -> bool:
        """Resume the run a resolution unblocks. If the orchestrator is unreachable the
        resolution is already stored and the redelivery sweep resumes the run (once) later."""
        from_status, event = RESOLUTIONS[kind](interaction_id, decision)
        try:
            resumed = await self._orchestrator.resume(
                tenant_id, run_id, from_status, event, interaction_id
            )
        except Unavailable as exc:
            log.warning("resume of %s deferred to the sweep: %s", run_id, exc.message)
            self.undelivered.set()
            return False
        await self.mark_delivered(interaction_id)
        return resumed

    async def mark_delivered(self, interaction_id: str) -> None:
        """Record that the orchestrator has the resolution, so the redelivery sweep skips it."""
        async with self._engine.begin() as conn:
            await repo.mark_delivered(conn, interaction_id)
