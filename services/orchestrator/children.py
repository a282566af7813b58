"""Run trees: the child runs a run's `delegate` calls start, the parent parked
`waiting-for-children` holding no worker, and its one way back but a cancel: queued again once,
when every child it started has ended, by whichever replica's waker finds it first.

A child is made under its parent's lease, in one transaction with the parent's `child.started`
(`intake.create_child_run`): the same (parent, call) always finds the same child
(ux_runs_tree_call), so a parent attempt that died after its call was recorded and issues it
again never starts a second. A turn's last delegate call parks its parent in that same
transaction (`park`), with the turn's progress not written yet (`checkpoint`): a delegation
costs its worker no park and no checkpoint of its own. The waker queues a parent whose children
have all ended in one statement (`children_repo.resume`: the parent locked with SKIP LOCKED,
each child's end recorded once as `child.completed`, the move waiting-for-children -> queued),
at once for the parent a child's end here names, and for every other one at least every
SCAN_EVERY_S. The parent's next lease says how each child ended (`budgets.leased_configs`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.orchestrator import budgets
from services.orchestrator.cancellation import cancel_instead
from services.orchestrator.cascade import Cancelled, cancel_orphans
from services.orchestrator.publisher import Publisher
from services.orchestrator.repositories import children as children_repo
from services.orchestrator.repositories import intake
from services.orchestrator.repositories import leases as lease_repo
from services.orchestrator.repositories.transitions import Moved, apply
from tether import states
from tether.bus import Bus
from tether.domain import (
    AgentConfig,
    Batch,
    Event,
    Limits,
    Run,
    RunError,
    StoredEvent,
    child_started,
    children_waiting,
)
from tether.errors import FailedPrecondition, InvalidArgument, StaleLease
from tether.ids import new_id
from tether.states import RunStatus

# The waker's looks at every waiting parent and every active child, at least this often while
# children ending here keep it busy with the parents they name.
SCAN_EVERY_S = 1.0


@dataclass(frozen=True, slots=True)
class ChildRun:
    """A delegate call's child as its parent's worker is answered: the run, and whether this
    call made it."""

    run: Run
    created: bool
    # Whether the parent parked waiting for its children in the same transaction (`park`).
    parked: bool = False

    @property
    def error(self) -> RunError | None:
        return None if self.run.error is None else RunError.from_row(self.run.error)


def _waiting(park: Sequence[str], tool_call_id: str, child: Run) -> list[str]:
    """The calls of `park` whose children the parent is to wait for, given the child of its
    call `tool_call_id` (one that ended already is waited for no more)."""
    ended = RunStatus(child.status).terminal
    return [c for c in park if c != tool_call_id or not ended]


async def _park(
    conn: AsyncConnection,
    run_id: str,
    epoch: int,
    tool_call_ids: Sequence[str],
    before: Sequence[Event] = (),
) -> Moved | None:
    """Park the run under lease `epoch` on the children of its calls `tool_call_ids`, its
    attempt ended, with `before` in its log ahead of children.waiting; None when it is not
    running under that lease (or a cancel was accepted)."""
    moved = await apply(
        conn,
        states.PARK_CHILDREN,
        run_id,
        epoch=epoch,
        events=[*before, children_waiting(tool_call_ids)],
        values=lease_repo.lease_cleared(),
    )
    if moved is not None:
        await lease_repo.end_attempt(conn, run_id, epoch, RunStatus.WAITING_FOR_CHILDREN.value)
    return moved


# Writes a checkpoint's batch under the lease on a connection: the events appended, with the
# fence's row; None when the lease is stale (`Attempts.write_batch`).
BatchWriter = Callable[
    [AsyncConnection, str, int, Batch], Awaitable[tuple[Any, list[StoredEvent]] | None]
]


class Children:
    """Starts child runs, parks their parents and wakes them, on this replica."""

    def __init__(
        self,
        engine: AsyncEngine,
        publisher: Publisher,
        bus: Bus | None = None,
        clock: Callable[[], float] = time.monotonic,
        write_batch: BatchWriter | None = None,
    ) -> None:
        self._engine = engine
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._clock = clock
        # How a checkpoint the call carries is written (`Attempts.write_batch`).
        self._write_batch = write_batch
        self._publisher = publisher
        self._bus = bus
        # Set when a run parks on its children here, or a child ends here: the waker looks
        # again at once, at the parents named (`Publisher.look_at_parent`).
        self.nudge = publisher.child_ended
        self._scanned: float | None = None  # the last look at every waiting parent

    async def start(
        self,
        run_id: str,
        epoch: int,
        *,
        tool_call_id: str,
        agent: str,
        message: str,
        max_depth: int,
        max_children: int,
        share: int = 1,
        park: Sequence[str] = (),
        new_call: bool = False,
        checkpoint: Batch | None = None,
    ) -> ChildRun:
        """The child run of `run_id`'s delegate call `tool_call_id`: the one it started before,
        or a new queued run of `agent` with `message`. InvalidArgument (nothing made) for an
        agent the tenant lacks, a child deeper than `max_depth` or more children than
        `max_children`, or when the parent has no budget left to reserve it 1/`share` of
        (`budgets`); StaleLease when the parent's lease is no longer current.

        `park`, on a turn's last delegate call, names the turn's calls whose children had not
        ended when started (this one among them): the parent then parks on those it still
        waits for in the same transaction, as `park` would, and its worker sends no park of
        its own (one round trip and one transaction fewer per delegation). A `new_call` (made
        in the attempt's own turn) has no child yet: it is not looked for before the lock.
        `checkpoint`, the attempt's progress not written yet, is written under the lock before
        anything else, and committed even when the child is refused."""
        if not tool_call_id or not agent or not message:
            raise InvalidArgument("a child run needs its delegate call, agent and message")
        # A call that started its child before (a resumed parent asks for each of its calls'):
        # one read, no lock. Anything else is decided under the parent's lock.
        if not new_call and checkpoint is None:
            async with self._engine.connect() as conn:
                before = await children_repo.started_child(conn, run_id, epoch, tool_call_id)
            if before is not None and not _waiting(park, tool_call_id, before):
                return ChildRun(before, created=False)
        refused: InvalidArgument | FailedPrecondition | None = None
        carried: list[StoredEvent] = []
        started: list[Event] = []
        logged: list[StoredEvent] = []
        parked = None
        async with self._engine.begin() as conn:
            held = await children_repo.held_parent(conn, run_id, epoch, tool_call_id, agent)
            if held is None:
                raise StaleLease(f"lease epoch {epoch} of run {run_id} is no longer current")
            if checkpoint is not None:
                carried = await self._carry(conn, run_id, epoch, checkpoint)
            try:
                if held.run.cancel_requested_at is not None:
                    # Its subtree was cancelled with it: a child made now would outlive it.
                    raise FailedPrecondition(
                        f"run {run_id} is being cancelled: it starts no more children",
                        code="cancel_requested",
                    )
                if held.child_id is not None:
                    child = await children_repo.child(conn, held.child_id)
                else:
                    child = await self._create(
                        conn, held, tool_call_id, agent, message, max_depth, max_children, share
                    )
                    started = [child_started(tool_call_id, child.run_id, agent)]
            except (InvalidArgument, FailedPrecondition) as exc:
                refused = exc  # nothing of the child was written; the checkpoint commits
            else:
                # Parking, its child.started goes in the park's own move.
                waiting = _waiting(park, tool_call_id, child)
                parked = await _park(conn, run_id, epoch, waiting, started) if waiting else None
                logged = parked.events if parked is not None else []
                if parked is None and started:
                    logged = await children_repo.append(conn, run_id, started)
        # The worker's next live deltas go out once this returns: they must not overtake these.
        await self._publisher.publish(held.run, carried, delivered=True)
        if refused is not None:
            raise refused
        await self._publisher.publish(held.run if parked is None else parked.run, logged)
        if started:
            self._publisher.wake([child.run_id])
        if parked is not None and (not started or len(waiting) > 1):
            # A child it found (not the one just made) may have ended already.
            self._publisher.look_at_parent(run_id)
        return ChildRun(child, created=bool(started), parked=parked is not None)

    async def _carry(
        self, conn: AsyncConnection, run_id: str, epoch: int, checkpoint: Batch
    ) -> list[StoredEvent]:
        """Write the checkpoint a delegate call carries, under the lock its call holds."""
        if self._write_batch is None:
            raise InvalidArgument("this orchestrator takes no checkpoint with a delegate call")
        written = await self._write_batch(conn, run_id, epoch, checkpoint)
        if written is None:
            raise StaleLease(f"lease epoch {epoch} of run {run_id} is no longer current")
        return written[1]

    @staticmethod
    async def _create(
        conn: AsyncConnection,
        held: children_repo.HeldParent,
        tool_call_id: str,
        agent: str,
        message: str,
        max_depth: int,
        max_children: int,
        share: int,
    ) -> Run:
        """A new queued child run of the held parent's call `tool_call_id`; InvalidArgument
        (nothing made) when the parent's pinned agent does not allow it or has no budget
        left for it."""
        parent = held.run
        # What the parent's agent allows is read from the routing it is pinned to, not
        # taken from the worker's word: the worker's limits may only be tighter.
        config = AgentConfig.from_json(held.config) if held.config else None
        allowed = None if config is None else config.delegation
        if allowed is None or agent not in allowed.agents:
            raise InvalidArgument(
                f"this run's agent may not delegate to {agent!r} (its document's "
                "delegation.agents does not name it): delegate to an agent it names, or do "
                "the task yourself"
            )
        max_depth = min(max_depth, allowed.max_depth)
        max_children = min(max_children, allowed.max_children)
        if not held.agent_published:
            raise InvalidArgument(
                f"there is no agent {agent!r} to delegate to (it was removed or never "
                "applied); delegate to another agent or do the task yourself"
            )
        if parent.tree_depth + 1 > max_depth:
            raise InvalidArgument(
                f"this run is {parent.tree_depth} deep in its tree and children may be at "
                f"most {max_depth} deep: do the task yourself"
            )
        if held.children >= max_children:
            raise InvalidArgument(
                f"this run has started its {max_children} children, as many as it may: "
                "do the rest yourself"
            )
        limits = config.limits if config is not None else Limits()
        budget = await budgets.child_budget(conn, parent, limits, share)
        return await intake.create_child_run(
            conn,
            parent,
            budget=budget,
            run_id=new_id("run"),
            session_id=new_id("ses"),
            message_id=new_id("msg"),
            tool_call_id=tool_call_id,
            agent=agent,
            text=message,
        )

    async def park(self, run_id: str, epoch: int, tool_call_ids: Sequence[str]) -> bool:
        """Park a run until its children have ended: lease released, session kept, no worker
        held. A run whose cancel was accepted ends cancelled instead."""
        async with self._engine.begin() as conn:
            moved = await _park(conn, run_id, epoch, tool_call_ids)
            if moved is None:
                moved = await cancel_instead(conn, run_id, epoch)
                if moved is None:
                    raise StaleLease(f"lease epoch {epoch} of run {run_id} is no longer current")
        await self._publisher.publish(moved.run, moved.events)
        if moved.run.status == RunStatus.WAITING_FOR_CHILDREN.value:
            self._publisher.look_at_parent(run_id)  # its children may all have ended already
        else:
            self._publisher.wake_next(moved)
        return True

    async def round(self) -> float | None:
        """Queue the parents whose children have all ended (first: a parent waits on it),
        cancel the children of parents that ended; nothing is due at a known time.

        A round a child's end (or a park) here started looks at the parents named, by id; the
        looks at every waiting parent and every active child (for what another replica saw,
        or a parent that ended) are made at least every SCAN_EVERY_S, not for each child's
        end: under a wide fan-out they read every parent waiting and every child running."""
        named = sorted(self._publisher.parents_to_look)
        self._publisher.parents_to_look.clear()
        if named:
            await self.resume_done(among=named)
        now = self._clock()
        if not named or self._scanned is None or now - self._scanned >= SCAN_EVERY_S:
            self._scanned = now
            await self.resume_done()
            await self.cancel_orphans()
        return None

    async def cancel_orphans(self, limit: int = 100) -> int:
        """Cancel the active children of runs that have ended (failed, reaped), and theirs."""
        done = Cancelled()
        async with self._engine.begin() as conn:
            found = await cancel_orphans(conn, limit, done)
        await done.publish(self._publisher, self._bus)
        return found

    async def resume_done(self, limit: int = 100, *, among: Sequence[str] | None = None) -> int:
        """Queue each run waiting for its children (those `among`, else the `limit` longest
        waiting with none active) once all of them have ended, with a child.completed for each
        child not reported before: one statement each (`children_repo.resume`)."""
        resumed: list[children_repo.Resumed] = []
        async with self._autocommit.connect() as conn:
            parents = list(among) if among is not None else None
            if parents is None:
                parents = await children_repo.parents_done(conn, limit)
            for parent in parents:
                found = await children_repo.resume(conn, parent)
                if found is not None:
                    resumed.append(found)
        for one in resumed:
            await self._publisher.publish(one, one.events)
        if resumed:
            self._publisher.wake([one.run_id for one in resumed])
        return len(resumed)
