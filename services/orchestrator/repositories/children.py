"""The SQL of run trees: a parent held under its lease while its delegate call's child is found
or made, its children counted, events appended to its log, and the parents whose children have
all ended, locked for the children's waker."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, func, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from services.orchestrator.repositories.agents import published
from services.orchestrator.repositories.transitions import (
    EVENT_COUNT,
    appended_events,
    event_params,
    numbered,
)
from tether.db.schema import in_state, routings, runs
from tether.domain import Event, Run, StoredEvent
from tether.states import TERMINAL, RunStatus

_TERMINAL = [s.value for s in TERMINAL]


@dataclass(frozen=True, slots=True)
class HeldParent:
    """A run under its lease, locked, as a delegate call finds it: whether the call started a
    child before (its id), how many children it has started, and the configuration of the
    routing it is pinned to (stored, None before its lease), and whether the agent its call
    names is one its tenant has."""

    run: Run
    child_id: str | None
    children: int
    config: Any
    # Whether its tenant has the agent the call names, published.
    agent_published: bool


# The parent, locked, with its pinned routing's configuration (which its lease does not change).
_HELD_PARENT = (
    select(
        runs,
        select(routings.c.config)
        .where(routings.c.routing_id == runs.c.routing_id)
        .scalar_subquery()
        .label("h_config"),
    )
    .where(
        runs.c.run_id == bindparam("h_run_id"),
        runs.c.status == RunStatus.RUNNING.value,
        runs.c.lease_epoch == bindparam("h_epoch"),
    )
    .with_for_update(of=runs)
)
# Its children, read once it is locked (in a statement of its own: a statement that waited for
# the lock would read them as they were before the holder's child committed).
_CHILD = runs.alias("child")
_CHILDREN = select(
    select(_CHILD.c.run_id)
    .where(
        _CHILD.c.tree_parent_run_id == bindparam("h_run_id"),
        _CHILD.c.tree_call_id == bindparam("h_call_id"),
    )
    .scalar_subquery()
    .label("child_id"),
    select(func.count())
    .select_from(_CHILD)
    .where(_CHILD.c.tree_parent_run_id == bindparam("h_run_id"))
    .scalar_subquery()
    .label("children"),
    published(
        select(runs.c.tenant_id).where(runs.c.run_id == bindparam("h_run_id")).scalar_subquery(),
        bindparam("h_agent"),
    ).label("agent_published"),
)


async def held_parent(
    conn: AsyncConnection, run_id: str, epoch: int, tool_call_id: str, agent: str
) -> HeldParent | None:
    """The run under lease `epoch`, locked until the transaction ends (its children are made
    one at a time), as its delegate call `tool_call_id` of `agent` finds it; None when the
    lease is no longer current."""
    params = {"h_run_id": run_id, "h_epoch": epoch, "h_call_id": tool_call_id, "h_agent": agent}
    row = (await conn.execute(_HELD_PARENT, params)).first()
    if row is None:
        return None
    found = (await conn.execute(_CHILDREN, params)).one()
    return HeldParent(
        Run.from_row(row._mapping),
        found.child_id,
        int(found.children),
        row.h_config,
        bool(found.agent_published),
    )


_PARENT = runs.alias("parent")
_STARTED = (
    select(runs)
    .join(_PARENT, _PARENT.c.run_id == runs.c.tree_parent_run_id)
    .where(
        _PARENT.c.run_id == bindparam("s_run_id"),
        _PARENT.c.status == RunStatus.RUNNING.value,
        _PARENT.c.lease_epoch == bindparam("s_epoch"),
        _PARENT.c.cancel_requested_at.is_(None),
        runs.c.tree_call_id == bindparam("s_call_id"),
    )
)


async def started_child(
    conn: AsyncConnection, run_id: str, epoch: int, tool_call_id: str
) -> Run | None:
    """The child the delegate call `tool_call_id` of run `run_id` started, read without a lock,
    while the run is under lease `epoch` and no cancel of it was accepted; None otherwise (not
    started, or the caller must look under the lock: `held_parent`). One statement: what a
    resumed parent's attempt asks of each of its calls."""
    row = (
        await conn.execute(
            _STARTED, {"s_run_id": run_id, "s_epoch": epoch, "s_call_id": tool_call_id}
        )
    ).first()
    return None if row is None else Run.from_row(row._mapping)


async def child(conn: AsyncConnection, run_id: str) -> Run:
    """A child run (one its parent's delegate call started)."""
    row = (await conn.execute(select(runs).where(runs.c.run_id == run_id))).one()
    return Run.from_row(row._mapping)


_APPENDED = (
    update(runs)
    .where(runs.c.run_id == bindparam("c_run_id"))
    .values(last_seq=runs.c.last_seq + EVENT_COUNT)
    .returning(runs.c.run_id, runs.c.last_seq)
    .cte("appended")
)
_APPEND = select(_APPENDED.c.run_id, _APPENDED.c.last_seq).add_cte(appended_events(_APPENDED))


async def append(conn: AsyncConnection, run_id: str, events: Sequence[Event]) -> list[StoredEvent]:
    """Append `events` to the run's log (a parent's child.started while it runs)."""
    row = (await conn.execute(_APPEND, {"c_run_id": run_id, **event_params(events)})).one()
    return numbered(row.last_seq, events)


async def parents_done(
    conn: AsyncConnection, limit: int, among: Sequence[str] | None = None
) -> list[str]:
    """Runs waiting for their children none of which is still active (of those `among`, by
    id, when given), oldest wait first, locked for the waker (ix_runs_children_waiting, or
    pk_runs); one another waker holds is skipped."""
    child = runs.alias("child")
    active = (
        select(child.c.run_id)
        .where(child.c.tree_parent_run_id == runs.c.run_id, child.c.status.not_in(_TERMINAL))
        .exists()
    )
    stmt = (
        select(runs.c.run_id)
        .where(in_state(runs.c.status, RunStatus.WAITING_FOR_CHILDREN), ~active)
        .where(*([] if among is None else [runs.c.run_id.in_(among)]))
        .order_by(runs.c.updated_at)
        .limit(limit)
        .with_for_update(of=runs, skip_locked=True)
    )
    return list((await conn.scalars(stmt)).all())


@dataclass(frozen=True, slots=True)
class Ended:
    """A child whose end its parent's log has not recorded yet."""

    run_id: str
    tool_call_id: str
    status: str


async def report_ended(conn: AsyncConnection, parent_run_id: str) -> list[Ended]:
    """The parent's ended children not reported to it yet, marked reported (each once)."""
    rows = await conn.execute(
        update(runs)
        .where(
            runs.c.tree_parent_run_id == parent_run_id,
            runs.c.tree_reported_at.is_(None),
            runs.c.status.in_(_TERMINAL),
        )
        .values(tree_reported_at=func.now())
        .returning(runs.c.run_id, runs.c.tree_call_id, runs.c.status, runs.c.finished_at)
    )
    found: list[Any] = sorted(rows, key=lambda r: (r.finished_at, r.run_id))
    return [Ended(r.run_id, r.tree_call_id or "", r.status) for r in found]


async def subtree(conn: AsyncConnection, run_id: str) -> list[Run]:
    """Every run below `run_id` in its tree (children first, then theirs), at any depth."""
    below = (
        select(runs.c.run_id, runs.c.tree_depth)
        .where(runs.c.tree_parent_run_id == run_id)
        .cte("below", recursive=True)
    )
    deeper = runs.alias("deeper")
    below = below.union_all(
        select(deeper.c.run_id, deeper.c.tree_depth).where(
            deeper.c.tree_parent_run_id == below.c.run_id
        )
    )
    rows = await conn.execute(
        select(runs).join(below, below.c.run_id == runs.c.run_id).order_by(runs.c.tree_depth)
    )
    return [Run.from_row(r._mapping) for r in rows]


@dataclass(frozen=True, slots=True)
class Orphan:
    """An active child run whose parent has ended."""

    run_id: str
    tenant_id: str
    tree_parent_run_id: str
    parent_status: str


async def orphans(conn: AsyncConnection, limit: int) -> list[Orphan]:
    """Active child runs whose parent has ended, locked for the waker (one another holds is
    skipped)."""
    parent = runs.alias("parent")
    rows = await conn.execute(
        select(runs.c.run_id, runs.c.tenant_id, runs.c.tree_parent_run_id, parent.c.status)
        .join(parent, parent.c.run_id == runs.c.tree_parent_run_id)
        .where(
            runs.c.tree_parent_run_id.is_not(None),
            runs.c.status.not_in(_TERMINAL),
            parent.c.status.in_(_TERMINAL),
        )
        .limit(limit)
        .with_for_update(of=runs, skip_locked=True)
    )
    return [Orphan(r.run_id, r.tenant_id, r.tree_parent_run_id, r.status) for r in rows]
