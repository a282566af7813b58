"""Reading runs (lookup, search, events, the facts interactions may know) and taking cancels.
The rooms that move runs under leases are wired in `execution.py`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncEngine

from services.orchestrator.cascade import Cancelled, cancel_below, cancel_one
from services.orchestrator.publisher import Publisher
from services.orchestrator.repositories import deliveries as deliveries_repo
from services.orchestrator.repositories import fair
from services.orchestrator.repositories import parts as parts_repo
from services.orchestrator.repositories import runs as runs_repo
from tether.bus import Bus
from tether.domain import (
    Attempt,
    Delivery,
    LoggedEvent,
    Part,
    PricedTurn,
    Run,
    RunRouting,
)
from tether.domain.agents import secret_names
from tether.states import RunStatus
from tether.visibility import Viewer

MAX_PAGE = 200
DEFAULT_PAGE = 50
MAX_EVENTS = 5000
DEFAULT_EVENTS = 1000


@dataclass(frozen=True)
class RunView:
    """A run with its persisted parts, and the routing decision it is pinned to (None until it
    is first leased, or when it was not asked for)."""

    run: Run
    parts: Sequence[Part]
    routing: RunRouting | None = None
    delivery: Delivery | None = None
    """A channel run's answer going out (its task outcome), when it has one."""
    # The cap on its tenant's runs running at once, when the run is queued behind it.
    held_by_cap: int | None = None


@dataclass(frozen=True)
class ExecutionRecord:
    """A run's attempts, priced model turns and lineage."""

    run: Run
    attempts: Sequence[Attempt]
    turns: Sequence[PricedTurn]
    lineage: Sequence[Run]


@dataclass(frozen=True)
class EventSlice:
    """Events after a cursor, optionally with the run's state."""

    events: Sequence[LoggedEvent]
    has_more: bool
    view: RunView | None


@dataclass(frozen=True)
class CancelOutcome:
    """The run after a cancel request, and whether the request changed it."""

    run: Run
    changed: bool


class Runs:
    """Queries over runs and the cancel request."""

    def __init__(self, engine: AsyncEngine, publisher: Publisher, bus: Bus | None) -> None:
        self._engine = engine
        # One-statement reads need no transaction around them.
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._publisher = publisher
        self._bus = bus

    async def lookup(
        self, viewer: Viewer, run_id: str, *, include_superseded: bool = False
    ) -> RunView:
        """The run and its transcript (with superseded parts when asked); NotFound for absent
        or not the viewer's to see."""
        async with self._engine.connect() as conn:
            run = await runs_repo.visible_run(conn, viewer, run_id)
            parts = await parts_repo.list_parts(conn, run_id, include_superseded=include_superseded)
            routing = await runs_repo.pinned_routing(conn, run)
            delivery = await deliveries_repo.find_run_delivery(conn, run.tenant_id, run_id)
            held = None
            if run.status == RunStatus.QUEUED.value:
                held = await fair.tenant_at_cap(conn, run.tenant_id)
            return RunView(run, parts, routing, delivery, held)

    async def visible(self, viewer: Viewer, run_id: str) -> Run:
        """The run (without its parts); NotFound for absent or not the viewer's to see."""
        async with self._autocommit.connect() as conn:
            return await runs_repo.visible_run(conn, viewer, run_id)

    async def facts(self, viewer: Viewer, run_id: str, held_epoch: int | None) -> tuple[Run, bool]:
        """The run (without its parts) and whether `held_epoch` is its live lease;
        NotFound for absent or not the viewer's to see."""
        async with self._autocommit.connect() as conn:
            return await runs_repo.visible_run_facts(conn, viewer, run_id, held_epoch)

    async def leased(self, run_id: str, epoch: int) -> tuple[Run, str, tuple[str, ...]]:
        """The run while `epoch` is its live lease, the approval policy of the routing it runs
        with ("" for none) and the secrets that routing names; StaleLease otherwise."""
        async with self._autocommit.connect() as conn:
            run = await runs_repo.leased_run(conn, run_id, epoch)
            routing = await runs_repo.routing_of(conn, run_id)
        return run, str(routing.get("approvals", "")), secret_names(routing)

    async def search(
        self,
        viewer: Viewer,
        *,
        statuses: Sequence[RunStatus],
        conversation_id: str,
        page_size: int,
        page_token: str,
        created_after: datetime | None = None,
        tree_root_run_id: str = "",
    ) -> tuple[Sequence[tuple[Run, RunRouting | None]], str]:
        """One page of runs, newest first, each with the routing decision it is pinned to."""
        size = min(page_size, MAX_PAGE) if page_size > 0 else DEFAULT_PAGE
        async with self._engine.connect() as conn:
            return await runs_repo.search_runs(
                conn,
                viewer,
                statuses=statuses,
                conversation_id=conversation_id,
                page_size=size,
                page_token=page_token,
                created_after=created_after,
                tree_root_run_id=tree_root_run_id,
            )

    async def execution_record(self, viewer: Viewer, run_id: str) -> ExecutionRecord:
        """The run's attempts, model turns and lineage, read in one snapshot; NotFound for
        absent or not the viewer's to see."""
        async with self._engine.connect() as conn, conn.begin():
            await conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            run = await runs_repo.visible_run(conn, viewer, run_id)
            return ExecutionRecord(
                run,
                await runs_repo.attempts_of(conn, run_id),
                await runs_repo.turns_of(conn, run_id),
                await runs_repo.lineage_of(conn, viewer, run),
            )

    async def read_events(
        self, viewer: Viewer, run_id: str, after_seq: int, limit: int, include_state: bool
    ) -> EventSlice:
        """Events after `after_seq`; the state, when asked, is read in the same snapshot."""
        size = min(limit, MAX_EVENTS) if limit > 0 else DEFAULT_EVENTS
        async with self._engine.connect() as conn, conn.begin():
            await conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            run = await runs_repo.visible_run(conn, viewer, run_id)
            stored = await runs_repo.read_events(conn, run_id, max(after_seq, 0), size + 1)
            rows = await runs_repo.filled_events(
                conn, run_id, stored, result_text=run.result_text, usage=run.usage
            )
            if include_state:
                parts = await parts_repo.list_parts(conn, run_id, include_superseded=False)
                delivery = await deliveries_repo.find_run_delivery(conn, run.tenant_id, run_id)
                view: RunView | None = RunView(run, parts, delivery=delivery)
            else:
                view = None
        return EventSlice(rows[:size], len(rows) > size, view)

    async def request_cancellation(self, viewer: Viewer, run_id: str, reason: str) -> CancelOutcome:
        """Cancel a run that holds no worker at once; flag a running one for its worker.

        A finished run is reported unchanged; a run the viewer may not see is NotFound.
        """
        tenant_id = viewer.tenant_id
        done = Cancelled()
        async with self._engine.begin() as conn:
            # Locked: a park, retry or completion landing between this read and the writes
            # below would otherwise leave a live run answered "unchanged".
            run = await runs_repo.visible_run(conn, viewer, run_id, lock=True)
            if RunStatus(run.status).terminal:
                return CancelOutcome(run, changed=False)
            moved, flagged = await cancel_one(conn, run_id, tenant_id, reason, done)
            # The run's whole subtree with it: no child runs on after its root was cancelled.
            await cancel_below(conn, run, done)
            current = (
                moved.run if moved else flagged or await runs_repo.visible_run(conn, viewer, run_id)
            )
        # Streams learn at once (they would find it in PostgreSQL a little later).
        await done.publish(self._publisher, self._bus)
        return CancelOutcome(current, changed=moved is not None or flagged is not None)
