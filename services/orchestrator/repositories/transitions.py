"""The run aggregate's moves: the state machine applied as one guarded UPDATE with its events, and
the two expressions every write of the aggregate shares, the lease fence and the event append.

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
    CTE,
    BigInteger,
    Boolean,
    Executable,
    Interval,
    Select,
    SmallInteger,
    Text,
    Update,
    and_,
    bindparam,
    case,
    cast,
    insert,
    literal,
    null,
    select,
    true,
    type_coerce,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, aggregate_order_by, array
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql import func
from sqlalchemy.sql.elements import BindParameter, ClauseElement, ColumnElement

from services.orchestrator.repositories import deliveries as deliveries_repo
from tether import formats
from tether.db.schema import in_state, run_events, runs, sessions
from tether.domain import (
    Delivery,
    Event,
    EventType,
    ModelTurn,
    Part,
    Run,
    StoredEvent,
    delivery_event,
    stored_by_reference,
)
from tether.domain.deliveries import ended_with_run
from tether.states import RunStatus, Transition

# -- the lease fence: every write under a lease is refused once the lease has moved on ----------

# Not named like a column: an UPDATE would take a parameter named so as a value to SET.
LEASE_EPOCH = bindparam("held_epoch", type_=BigInteger)


def lease_held(epoch: Any) -> ColumnElement[bool]:
    """The one lease fence: the run is running under `epoch` (an expression). A worker whose
    lease was reaped, released or taken over matches nothing and writes nothing."""
    return and_(runs.c.status == RunStatus.RUNNING.value, runs.c.lease_epoch == epoch)


# The fence for one lease, its epoch bound as :held_epoch.
LEASE_HELD = lease_held(LEASE_EPOCH)

# -- the event append: a run's events take the seqs the statement that moved it reserved --------

# The types of the bound events, in order (a statement's turns find their usage.updated here).
EVENT_TYPES = bindparam("e_types", type_=ARRAY(Text))
_E_PAYLOADS = bindparam("e_payloads", type_=ARRAY(Text))
# How many events the statement appends: what `last_seq` advances by.
EVENT_COUNT = func.coalesce(func.cardinality(EVENT_TYPES), 0)
# Whether the events a statement appends to a run go in one row (stored format 6,
# `formats.EVENTS_TOGETHER`); unbound, each goes in a row of its own.
_TOGETHER = bindparam("e_together", value=False, type_=Boolean)


def event_count(computed: Sequence[Event] = ()) -> ColumnElement[Any]:
    """What a move's `last_seq` advances by: EVENT_COUNT for the bound events, or the number of
    `computed` ones (see `appended_events`)."""
    return literal(len(computed), BigInteger) if computed else EVENT_COUNT


def event_params(events: Sequence[Event], *, together: bool = False) -> dict[str, Any]:
    """The bound values of `appended_events`: `events` as given, in one row when `together`
    (stored format 6) and there are more than one."""
    return {
        "e_types": [str(e.type) for e in events],
        "e_payloads": [json.dumps(dict(e.payload)) for e in events],
        "e_together": together,
    }


def stored_event_params(
    events: Sequence[Event],
    parts: Sequence[Part],
    turns: Sequence[ModelTurn],
    stored_format: int,
) -> dict[str, Any]:
    """`event_params` of a batch that writes `parts` and `turns` with its `events`, each stored
    by reference where it may be, up to `stored_format` (`stored_by_reference`): its parts'
    events (3) and each usage.updated without the turn its row keeps (4; `paired_turns`); and
    together in one row (6)."""
    if stored_format < formats.BY_REFERENCE:
        return event_params(events)
    written = {p.index for p in parts}
    paired = paired_turns(events, turns) if stored_format >= formats.USAGE_BY_REFERENCE else {}
    return event_params(
        [stored_by_reference(e, written, turn=paired.get(i)) for i, e in enumerate(events)],
        together=stored_format >= formats.EVENTS_TOGETHER,
    )


def appended_events(moved: CTE, computed: Sequence[Event] = ()) -> CTE:
    """The insert of the events bound by `event_params` after `moved`, a CTE that returns the
    run's `run_id` and its `last_seq` already advanced by EVENT_COUNT: the events take the seqs
    it reserved, in order, in the current stored format, and none is written when it matched no
    row. Each is a row of its own; bound `e_together` (stored format 6), a run's events are one
    row when there are more than one, under the last one's seq. Every append to a run's log
    goes through here (a run's run.queued and each run.started are not appended: the log reads
    them from the run's and the attempt's rows, migration 0048).

    `computed` events take the place of the bound ones, for a statement that moves many runs
    and writes what it decided itself (a timer's due time): each row of `moved` gets them, with
    payloads whose values may be SQL expressions over `moved`'s columns (`computed_payload`),
    and its move advances `last_seq` by `event_count(computed)`."""
    types: Any = EVENT_TYPES
    payloads: Any = _E_PAYLOADS
    if computed:
        types = array([literal(str(e.type), Text) for e in computed])
        payloads = array([cast(computed_payload(e), Text) for e in computed])
    batch = (
        func.unnest(types, payloads)
        .table_valued("type", "payload", with_ordinality="ord")
        .render_derived("e", with_types=False)
    )
    payload = cast(batch.c.payload, JSONB)
    each = (
        select(
            moved.c.run_id,
            (moved.c.last_seq - event_count(computed) + batch.c.ord).label("seq"),
            batch.c.type,
            payload.label("payload"),
            _stored_format(batch.c.type, payload).label("format"),
            batch.c.ord,
        )
        .select_from(moved.join(batch, true()))
        .subquery("each_event")
    )
    # A run's events in one group when together, each in a group of its own otherwise; a group
    # of one is its event's row, a larger one a row of them all (`formats.EVENTS_TOGETHER`).
    alone = func.count() == 1
    together = [
        func.jsonb_build_array(each.c.type, each.c.format, each.c.payload),
        each.c.ord,
    ]
    rows = select(
        each.c.run_id,
        func.max(each.c.seq),
        case((alone, func.min(each.c.type)), else_=literal(formats.TOGETHER_TYPE, Text)),
        case(
            (alone, type_coerce(func.jsonb_agg(each.c.payload).op("->")(0), JSONB)),
            else_=func.jsonb_agg(aggregate_order_by(*together)),
        ),
        case(
            (alone, func.min(each.c.format)),
            else_=literal(formats.EVENTS_TOGETHER, SmallInteger),
        ),
    ).group_by(each.c.run_id, case((_TOGETHER, 0), else_=each.c.ord))
    insert_ = insert(run_events).from_select(["run_id", "seq", "type", "payload", "format"], rows)
    return insert_.cte(f"{moved.name}_events")


def _stored_format(type_: Any, payload: Any) -> ColumnElement[Any]:
    """The format an event is stored in, as `formats.written` says: the by-reference format of
    an event stored without the key only its whole form has, CURRENT for every other
    (test_completion_statement's test_a_completion_stores_each_record_once holds the two
    equal)."""
    return case(
        *[
            ((type_ == str(kind)) & ~payload.has_key(whole), literal(stored, SmallInteger))
            for kind, (whole, stored) in formats.BY_REFERENCE_WITHOUT.items()
        ],
        else_=literal(formats.CURRENT, SmallInteger),
    )


def paired_turns(events: Sequence[Event], turns: Sequence[ModelTurn]) -> dict[int, ModelTurn]:
    """The turn of each usage.updated among a batch's `events`, by its place: its k-th
    usage.updated is its k-th turn's, as the statement's `usage_turns.event_seq` records, when
    there is one event for each turn (the worker records the two together); none otherwise."""
    usage = [i for i, e in enumerate(events) if e.type == EventType.USAGE_UPDATED]
    return dict(zip(usage, turns, strict=True)) if len(usage) == len(turns) else {}


def computed_payload(event: Event) -> ColumnElement[Any]:
    """`event`'s payload as a JSONB expression. Its constructor (`tether.domain`) was called with
    SQL expressions for what only the statement knows (`sql_value`), so the payload's shape is
    still written once, there."""
    return _json_object(event.payload)


def sql_value(expression: ColumnElement[Any]) -> Any:
    """`expression` passed where an event constructor takes a plain value (`computed_payload`)."""
    return expression


def _json_object(mapping: Mapping[str, Any]) -> ColumnElement[Any]:
    return func.jsonb_build_object(
        *[item for key, value in mapping.items() for item in (literal(key), _json(value))]
    )


def _json(value: Any) -> ColumnElement[Any]:
    if isinstance(value, Mapping):
        return _json_object(value)
    if isinstance(value, BindParameter):
        return cast(value, value.type)  # jsonb_build_object's arguments are untyped
    if isinstance(value, ColumnElement):
        return value
    return literal(value)


def numbered(last_seq: int, events: Sequence[Event]) -> list[StoredEvent]:
    """`events` as appended by a statement that left the run at `last_seq`."""
    first = last_seq - len(events) + 1
    return [StoredEvent(first + i, event) for i, event in enumerate(events)]


@dataclass(frozen=True)
class Moved:
    """A transition that applied: the run as it now stands, the events appended with their seqs,
    and the run a terminal move made its session's head (it may now be claimed)."""

    run: Run
    events: list[StoredEvent]
    handed_over: str | None = None


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
) -> Moved | None:
    """Move `run_id` along `transition`, appending `events`; None means it had already moved.

    A fenced transition also requires the lease (LEASE_HELD with `epoch`), so a worker whose
    lease was reaped cannot write; one that yields to a cancel also requires that none was
    requested. `tenant_id`, when given, scopes the move to the caller's tenant; `waiting_on` to
    a run parked on that interaction (no other one may move it). `params` binds what
    expressions among `values` leave open (e.g. `lease_ttl`). A terminal move hands the session
    to its next queued message (`Moved.handed_over`).
    """
    if transition.fenced and epoch is None:
        raise ValueError(f"transition {transition.name} needs the lease epoch")
    # A run ending with its answer's delivery still open (the reaper spent its attempts, a
    # parked run was cancelled) gives that delivery its outcome in the same transaction, its
    # delivery.* event before the run's own: no delivery is left without one.
    closing: list[Delivery] = []
    if transition.target.terminal:
        status = transition.target.value
        opened = await deliveries_repo.open_deliveries(conn, run_id)
        closing = [ended_with_run(d, status) for d in opened]
        events = [*(delivery_event(d) for d in closing), *events]
    values = dict(values or {})
    stmt = _shape(transition, tenant_id is not None, bool(events), values, waiting_on is not None)
    bound: dict[str, Any] = {
        "t_run_id": run_id,
        "held_epoch": epoch,
        "t_tenant_id": tenant_id,
        "t_waiting_on": waiting_on,
        **event_params(events),
        **{f"v_{k}": v for k, v in values.items() if _bound(v)},
        **dict(params or {}),
    }
    row = (await conn.execute(stmt, bound)).first()
    if row is None:
        return None
    handed_over = None
    if transition.target.terminal:
        handed_over = await hand_over_session(conn, row.session_id, run_id)
        for delivery in closing:
            await deliveries_repo.close_delivery(conn, delivery)
    return Moved(Run.from_row(row._mapping), numbered(row.last_seq, events), handed_over)


def move_statement(transition: Transition, values: Mapping[str, Any]) -> Executable:
    """The statement `apply` runs for `transition` with its events (unscoped): for the SQL
    functions built from the aggregate's statements. A value that is SQL is written into it,
    None is NULL, and anything else is bound as `v_<column>`."""
    return _shape(transition, False, True, values)


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
        .where(runs.c.run_id == bindparam("t_run_id"))
        .values(
            status=transition.target.value,
            updated_at=NOW,
            last_seq=runs.c.last_seq + EVENT_COUNT,
            **{
                k: bindparam(f"v_{k}", type_=runs.c[k].type) if _bound(v) else v
                for k, v in values.items()
            },
        )
        .returning(*runs.c)
    )
    if transition.fenced:
        stmt = stmt.where(LEASE_HELD)  # every fenced move leaves running (tether.states)
    else:
        stmt = stmt.where(runs.c.status.in_([s.value for s in transition.sources]))
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
    """`move` and the insert of its events as ONE statement (one round trip)."""
    moved = move.cte("moved")
    return select(moved).add_cte(appended_events(moved))


# The session locked when the finishing run heads it (no row otherwise: nothing to hand over);
# then, in a statement of its own, the hand-over. See `hand_over_session`.
LOCK_SESSION = (
    select(sessions.c.active_run_id)
    .where(
        sessions.c.session_id == bindparam("h_session_id"),
        sessions.c.active_run_id == bindparam("h_run_id"),
    )
    .with_for_update()
)
_NEXT_QUEUED = (
    select(runs.c.run_id)
    .where(
        runs.c.session_id == bindparam("h_session_id"),
        # Written in: the session's queued runs are ix_runs_session_queued's, the one index of
        # runs by session (0047 dropped ix_runs_session_created).
        in_state(runs.c.status, RunStatus.QUEUED),
        runs.c.run_id != bindparam("h_run_id"),
    )
    .order_by(runs.c.created_at, runs.c.run_id)
    .limit(1)
    .cte("next_run")
)
# The oldest queued message becomes the session's active run and its head, in one statement;
# with none, the session goes idle (active_run_id NULL) and no run is touched.
HAND_OVER = (
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
    params = {"h_session_id": session_id, "h_run_id": run_id}
    if (await conn.execute(LOCK_SESSION, params)).first() is None:
        return None
    # A statement of its own, after the lock: its snapshot sees every run admitted before.
    next_run: str | None = (await conn.execute(HAND_OVER, params)).scalar()
    return next_run
