"""Applies the state machine's transitions: one guarded UPDATE plus its events, one transaction.

Callers pass an open connection inside a transaction; the event rows are appended with
consecutive `seq` values taken from the same UPDATE that moved the run, so the log and the status
can never disagree.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    Executable,
    Integer,
    Interval,
    Select,
    Text,
    Update,
    bindparam,
    cast,
    insert,
    null,
    select,
    true,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql import func
from sqlalchemy.sql.elements import ClauseElement

from tether.db.schema import run_events, runs, sessions
from tether.states import Transition


@dataclass(frozen=True)
class Event:
    """A durable event to append: its stable type name and JSON payload."""

    type: str
    payload: Mapping[str, Any]


# Statements are built once per shape and reused: building and cache-keying a CTE per call cost
# more CPU than running it. The shape is the transition, which guards apply, whether events are
# appended, and the set columns; a value that is a SQL expression is part of the shape by
# identity (so pass module-level expressions such as NOW on hot paths), a plain value is bound.
_SHAPES: collections.OrderedDict[tuple[Any, ...], tuple[Executable, list[Any]]] = (
    collections.OrderedDict()
)
_MAX_SHAPES = 512

# Set values for hot paths, shared so their statements are reused.
NOW = func.now()
NEXT_EPOCH = runs.c.lease_epoch + 1
STARTED_ONCE = func.coalesce(runs.c.started_at, func.now())
LEASE_UNTIL = func.now() + bindparam("lease_ttl", type_=Interval)  # bind lease_ttl in `params`


async def apply(
    conn: AsyncConnection,
    transition: Transition,
    run_id: str,
    *,
    events: Sequence[Event],
    epoch: int | None = None,
    tenant_id: str | None = None,
    waiting_on: str | None = None,
    values: Mapping[str, Any] | None = None,
    params: Mapping[str, Any] | None = None,
    handed_over: list[str] | None = None,
) -> Row[Any] | None:
    """Move `run_id` along `transition`, appending `events`; None means it had already moved.

    A fenced transition also requires `lease_epoch = epoch`, so a worker whose lease was reaped
    cannot write; one that yields to a cancel also requires that none was requested.
    `tenant_id`, when given, scopes the move to the caller's tenant; `waiting_on` to a run
    parked on that interaction (no other one may move it). `params` binds what expressions
    among `values` leave open (e.g. `lease_ttl`). A terminal move hands the
    session to its next queued message, whose run id goes into `handed_over`.
    """
    if transition.fenced and epoch is None:
        raise ValueError(f"transition {transition.name} needs the lease epoch")
    values = dict(values or {})
    stmt = _shape(transition, tenant_id is not None, bool(events), values, waiting_on is not None)
    bound: dict[str, Any] = {
        "t_run_id": run_id,
        "t_epoch": epoch,
        "t_tenant_id": tenant_id,
        "t_waiting_on": waiting_on,
        "t_n_events": len(events),
        **{f"v_{k}": v for k, v in values.items() if _bound(v)},
        **dict(params or {}),
    }
    if events:
        bound["t_e_types"] = [e.type for e in events]
        bound["t_e_payloads"] = [json.dumps(dict(e.payload)) for e in events]
    row = (await conn.execute(stmt, bound)).first()
    if row is None:
        return None
    if transition.target.terminal:
        next_run = await hand_over_session(conn, row.session_id, run_id)
        if next_run is not None and handed_over is not None:
            handed_over.append(next_run)
    return row


def _shape(
    transition: Transition,
    scoped: bool,
    with_events: bool,
    values: Mapping[str, Any],
    bound_to_interaction: bool = False,
) -> Executable:
    values = {k: null() if v is None else v for k, v in values.items()}
    expressions = [v for v in values.values() if not _bound(v)]
    key = (
        transition.name,
        scoped,
        with_events,
        tuple((k, None if _bound(v) else id(v)) for k, v in sorted(values.items())),
        bound_to_interaction,
    )
    cached = _SHAPES.get(key)
    if cached is not None:
        _SHAPES.move_to_end(key)
        return cached[0]
    stmt = (
        update(runs)
        .where(
            runs.c.run_id == bindparam("t_run_id"),
            runs.c.status.in_([s.value for s in transition.sources]),
        )
        .values(
            status=transition.target.value,
            updated_at=NOW,
            last_seq=runs.c.last_seq + bindparam("t_n_events", type_=Integer),
            **{
                k: bindparam(f"v_{k}", type_=runs.c[k].type) if _bound(v) else v
                for k, v in values.items()
            },
        )
        .returning(*runs.c)
    )
    if transition.fenced:
        stmt = stmt.where(runs.c.lease_epoch == bindparam("t_epoch"))
    if transition.yields_to_cancel:
        # An accepted cancel is never dropped: this move is refused, and the run ends cancelled.
        stmt = stmt.where(runs.c.cancel_requested_at.is_(None))
    if scoped:
        stmt = stmt.where(runs.c.tenant_id == bindparam("t_tenant_id"))
    if bound_to_interaction:
        stmt = stmt.where(runs.c.waiting_interaction_id == bindparam("t_waiting_on"))
    built: Executable = _with_events(stmt) if with_events else stmt
    # The expressions stay referenced with the entry, so their ids cannot be reused meanwhile.
    _SHAPES[key] = (built, expressions)
    if len(_SHAPES) > _MAX_SHAPES:
        _SHAPES.popitem(last=False)
    return built


def _bound(value: Any) -> bool:
    """Whether a set value is bound as a parameter: not SQL, and not None (SQL NULL, never a
    JSON null)."""
    return value is not None and not isinstance(value, ClauseElement)


def _with_events(move: Update) -> Select[Any]:
    """`move` and the insert of its events as ONE statement (one round trip): the events take
    the seqs the move reserved, and are written only if the move matched."""
    moved = move.cte("moved")
    batch = (
        func.unnest(
            bindparam("t_e_types", type_=ARRAY(Text)),
            bindparam("t_e_payloads", type_=ARRAY(Text)),
        )
        .table_valued("type", "payload", with_ordinality="ord")
        .render_derived("e", with_types=False)
    )
    rows = select(
        moved.c.run_id,
        moved.c.last_seq - bindparam("t_n_events", type_=Integer) + batch.c.ord,
        batch.c.type,
        cast(batch.c.payload, JSONB),
    ).select_from(moved.join(batch, true()))
    appended = insert(run_events).from_select(["run_id", "seq", "type", "payload"], rows)
    return select(moved).add_cte(appended.cte("appended"))


_LOCK_SESSION = (
    select(sessions.c.active_run_id)
    .where(sessions.c.session_id == bindparam("h_session_id"))
    .with_for_update()
)
_NEXT_QUEUED = (
    select(runs.c.run_id)
    .where(
        runs.c.session_id == bindparam("h_session_id"),
        runs.c.status == "queued",
        runs.c.run_id != bindparam("h_run_id"),
    )
    .order_by(runs.c.created_at, runs.c.run_id)
    .limit(1)
    .cte("next_run")
)
# The oldest queued message becomes the session's active run and its head, in one statement;
# with none, the session goes idle (active_run_id NULL) and no run is touched.
_HAND_OVER = (
    select(_NEXT_QUEUED.c.run_id)
    .add_cte(
        update(sessions)
        .where(sessions.c.session_id == bindparam("h_session_id"))
        .values(active_run_id=select(_NEXT_QUEUED.c.run_id).scalar_subquery())
        .cte("set_active")
    )
    .add_cte(
        update(runs)
        .where(runs.c.run_id == select(_NEXT_QUEUED.c.run_id).scalar_subquery())
        .values(session_head=True)
        .cte("made_head")
    )
)


async def hand_over_session(conn: AsyncConnection, session_id: str, run_id: str) -> str | None:
    """If `run_id` heads its session, make the oldest queued message the head (or none).

    The session row is locked first, in its own statement, so the search for the next run
    sees every run admitted before the lock was granted (admission takes the same lock): no
    message is ever left queued behind a head that is gone.
    """
    locked = (await conn.execute(_LOCK_SESSION, {"h_session_id": session_id})).first()
    if locked is None or locked.active_run_id != run_id:
        return None
    params = {"h_session_id": session_id, "h_run_id": run_id}
    # A statement of its own, after the lock: its snapshot sees every run admitted before.
    next_run: str | None = (await conn.execute(_HAND_OVER, params)).scalar()
    return next_run


async def insert_events(
    conn: AsyncConnection, run_id: str, after_seq: int, events: Sequence[Event]
) -> None:
    """Insert `events` with seq after_seq+1, after_seq+2, ...; the caller reserved the range."""
    if not events:
        return
    await conn.execute(
        insert(run_events),
        [
            {"run_id": run_id, "seq": after_seq + i, "type": e.type, "payload": dict(e.payload)}
            for i, e in enumerate(events, start=1)
        ],
    )
