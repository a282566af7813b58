"""The SQL of run trees: a parent held under its lease while its delegate call's child is found
or made, its children counted, events appended to its log, and the parents whose children have
all ended, locked for the children's waker."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from typing import cast as cast_type

from sqlalchemy import (
    SmallInteger,
    Text,
    bindparam,
    cast,
    func,
    insert,
    literal,
    select,
    true,
    union_all,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.selectable import Alias

from services.orchestrator.repositories.agents import published
from services.orchestrator.repositories.answers import READ_RUN
from services.orchestrator.repositories.transitions import (
    EVENT_COUNT,
    appended_events,
    event_params,
    numbered,
)
from tether import formats
from tether.db.schema import in_state, routings, run_events, runs
from tether.domain import Event, EventType, Run, StoredEvent, child_completed, run_queued
from tether.states import CHILDREN_DONE, TERMINAL, RunStatus

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
    select(*READ_RUN)
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
    row = (await conn.execute(select(*READ_RUN).where(runs.c.run_id == run_id))).one()
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


_ACTIVE_CHILD = runs.alias("active_child")
# Whether the run in the statement's `runs` has a child still active.
_HAS_ACTIVE_CHILD = (
    select(_ACTIVE_CHILD.c.run_id)
    .where(
        _ACTIVE_CHILD.c.tree_parent_run_id == runs.c.run_id,
        _ACTIVE_CHILD.c.status.not_in(_TERMINAL),
    )
    .exists()
)


async def parents_done(conn: AsyncConnection, limit: int) -> list[str]:
    """Runs waiting for their children none of which is still active, oldest wait first
    (ix_runs_children_waiting): each to be resumed by `resume`, which looks again under the
    parent's lock."""
    stmt = (
        select(runs.c.run_id)
        .where(in_state(runs.c.status, RunStatus.WAITING_FOR_CHILDREN), ~_HAS_ACTIVE_CHILD)
        .order_by(runs.c.updated_at)
        .limit(limit)
    )
    return list((await conn.scalars(stmt)).all())


# One parent's resume (tether.states.CHILDREN_DONE) as ONE statement: the parent locked
# (skipped when another holds it) while it waits for children none of which is still active;
# each ended child not reported yet marked reported, with its child.completed (in the order
# they finished); the move to queued with run.queued last. Nothing is written when the parent
# is not waiting, is locked, or has a child still active.
_DONE_PARENT = (
    select(runs.c.run_id)
    .where(
        runs.c.run_id == bindparam("r_parent"),
        in_state(runs.c.status, *CHILDREN_DONE.sources),
        ~_HAS_ACTIVE_CHILD,
    )
    .with_for_update(of=runs, skip_locked=True)
    .cte("done_parent")
)
# (An alias of runs to update, which SQLAlchemy types as a read-only FROM.)
_ENDED = cast_type(Alias, runs.alias("ended_child"))
_REPORTED = (
    update(_ENDED)
    .where(
        _ENDED.c.tree_parent_run_id == _DONE_PARENT.c.run_id,
        _ENDED.c.tree_reported_at.is_(None),
        _ENDED.c.status.in_(_TERMINAL),
    )
    .values(tree_reported_at=func.now())
    .returning(_ENDED.c.run_id, _ENDED.c.tree_call_id, _ENDED.c.status, _ENDED.c.finished_at)
    .cte("reported")
)
_KEYS = tuple(child_completed("call", "run", "status").payload)  # toolCallId, childRunId, status
_RESUME_EVENTS = union_all(
    select(
        literal(EventType.CHILD_COMPLETED.value, Text).label("type"),
        cast(
            func.jsonb_build_object(
                _KEYS[0],
                func.coalesce(_REPORTED.c.tree_call_id, ""),
                _KEYS[1],
                _REPORTED.c.run_id,
                _KEYS[2],
                _REPORTED.c.status,
            ),
            Text,
        ).label("payload"),
        func.row_number().over(order_by=(_REPORTED.c.finished_at, _REPORTED.c.run_id)).label("ord"),
    ),
    select(
        literal(EventType.RUN_QUEUED.value, Text),
        literal(json.dumps(run_queued(0, "children").payload), Text),
        select(func.count()).select_from(_REPORTED).scalar_subquery() + 1,
    ),
).cte("resume_events")
_EVENTS_COUNT = select(func.count()).select_from(_RESUME_EVENTS).scalar_subquery()
_RESUMED = (
    update(runs)
    .where(
        runs.c.run_id == _DONE_PARENT.c.run_id,
        in_state(runs.c.status, *CHILDREN_DONE.sources),
    )
    .values(
        status=CHILDREN_DONE.target.value,
        updated_at=func.now(),
        last_seq=runs.c.last_seq + _EVENTS_COUNT,
    )
    .returning(runs.c.run_id, runs.c.tenant_id, runs.c.owner_principal_id, runs.c.last_seq)
    .cte("resumed")
)
_RESUMED_LOG = (
    insert(run_events)
    .from_select(
        ["run_id", "seq", "type", "payload", "format"],
        select(
            _RESUMED.c.run_id,
            _RESUMED.c.last_seq - _EVENTS_COUNT + _RESUME_EVENTS.c.ord,
            _RESUME_EVENTS.c.type,
            cast(_RESUME_EVENTS.c.payload, JSONB),
            literal(formats.CURRENT, SmallInteger),
        ).select_from(_RESUMED.join(_RESUME_EVENTS, true())),
    )
    .cte("resumed_log")
)
_RESUME = (
    select(
        _RESUMED.c.run_id,
        _RESUMED.c.tenant_id,
        _RESUMED.c.owner_principal_id,
        _RESUMED.c.last_seq,
        _RESUME_EVENTS.c.type,
        _RESUME_EVENTS.c.payload,
    )
    .select_from(_RESUMED.join(_RESUME_EVENTS, true()))
    .add_cte(_RESUMED_LOG)
    .order_by(_RESUME_EVENTS.c.ord)
)


@dataclass(frozen=True, slots=True)
class Resumed:
    """A parent queued again once its children had all ended, with the events that did it
    (a child.completed per child not reported before, then run.queued)."""

    run_id: str
    tenant_id: str
    owner_principal_id: str | None
    events: list[StoredEvent]


async def resume(conn: AsyncConnection, parent_run_id: str) -> Resumed | None:
    """Queue the parent again when it waits for children none of which is still active, in
    one statement (see `_RESUME`); None when it does not (or another waker holds it)."""
    rows = (await conn.execute(_RESUME, {"r_parent": parent_run_id})).all()
    if not rows:
        return None
    first = rows[0]
    events = [Event(EventType(r.type), json.loads(r.payload)) for r in rows]
    return Resumed(
        first.run_id, first.tenant_id, first.owner_principal_id, numbered(first.last_seq, events)
    )


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
