"""Pauses: a run parked for a person (a question, an approval, a connection) with no worker
held, and its one way back: resumed by the interaction it is parked on, or failed when that
pause outlives its TTL. Only the bound interaction may end a pause."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine

from services.orchestrator import observed
from services.orchestrator.cancellation import cancel_instead
from services.orchestrator.publisher import Publisher
from services.orchestrator.repositories import leases as lease_repo
from services.orchestrator.repositories import parts as parts_repo
from services.orchestrator.repositories.runs import get_run
from services.orchestrator.repositories.transitions import NOW, apply
from tether import states, telemetry
from tether.domain import Event, Interruption, RunError, interaction_event, run_failed, run_queued
from tether.errors import InvalidArgument, StaleLease
from tether.states import RunStatus

_PARK = {
    RunStatus.WAITING_FOR_QUESTION: states.PARK_QUESTION,
    RunStatus.WAITING_FOR_APPROVAL: states.PARK_APPROVAL,
    RunStatus.WAITING_FOR_CONNECTION: states.PARK_CONNECTION,
}


class Pauses:
    """Parks, resumes and expires runs waiting on people."""

    def __init__(self, engine: AsyncEngine, publisher: Publisher) -> None:
        self._engine = engine
        self._publisher = publisher

    async def park(self, run_id: str, epoch: int, status: RunStatus, interaction_id: str) -> bool:
        """Park a run for a person: lease released, session kept, no worker held. A run whose
        cancel was accepted ends cancelled instead of waiting for anyone."""
        transition = _PARK.get(status)
        if transition is None:
            raise InvalidArgument("status must be one of the waiting-for-* statuses")
        async with self._engine.begin() as conn:
            moved = await apply(
                conn,
                transition,
                run_id,
                epoch=epoch,
                events=[interaction_event(transition.event_type, interaction_id)],
                values={**lease_repo.lease_cleared(), "waiting_interaction_id": interaction_id},
            )
            if moved is not None:
                await lease_repo.end_attempt(conn, run_id, epoch, status.value)
            else:
                moved = await cancel_instead(conn, run_id, epoch)
                if moved is None:
                    raise StaleLease(f"lease epoch {epoch} of run {run_id} is no longer current")
        await self._publisher.publish(moved.run, moved.events)
        self._publisher.wake_next(moved)  # a cancelled run hands its session on
        return True

    async def resume(
        self,
        tenant_id: str,
        run_id: str,
        from_status: RunStatus,
        event: Event | None,
        interaction_id: str,
    ) -> bool:
        """Queue a run parked on `interaction_id` once; False when it had already moved or
        waits on another interaction (an orphan, stored by a worker that died before parking
        on it, wakes nothing)."""
        if not from_status.waiting:
            raise InvalidArgument("from_status must be a waiting-for-* status")
        if not interaction_id:
            raise InvalidArgument("interaction_id is required: a resume names the pause it ends")
        async with self._engine.begin() as conn:
            await get_run(conn, tenant_id, run_id)
            moved = await apply(
                conn,
                states.RESUME,
                run_id,
                tenant_id=tenant_id,
                waiting_on=interaction_id,
                events=[*([event] if event else []), run_queued(0, "resumed")],
                values={"waiting_interaction_id": None},
            )
        if moved is None:
            return False
        if telemetry.on:
            observed.resumed(moved.run)
        await self._publisher.publish(moved.run, moved.events)
        self._publisher.wake([run_id])
        return True

    async def expire_waiting(
        self,
        tenant_id: str,
        run_id: str,
        from_status: RunStatus,
        error: RunError,
        event: Event | None,
        interaction_id: str,
    ) -> bool:
        """Fail a run whose pause on `interaction_id` outlived its TTL; False when it had
        already moved or waits on another interaction."""
        if from_status is not RunStatus.WAITING_FOR_CONNECTION:
            raise InvalidArgument("only a waiting-for-connection run expires")
        if not interaction_id:
            raise InvalidArgument("interaction_id is required: an expiry names the pause it ends")
        async with self._engine.begin() as conn:
            moved = await apply(
                conn,
                states.CONSENT_EXPIRED,
                run_id,
                tenant_id=tenant_id,
                waiting_on=interaction_id,
                events=[*([event] if event else []), run_failed(error)],
                values={
                    "error": error.to_row(),
                    "finished_at": NOW,
                    "waiting_interaction_id": None,
                },
            )
            if moved is not None:
                await parts_repo.close_dangling(
                    conn, moved.run, Interruption.CONNECTION_NEVER_COMPLETED
                )
        if moved is None:
            return False
        await self._publisher.publish(moved.run, moved.events)
        self._publisher.wake_next(moved)
        return True
