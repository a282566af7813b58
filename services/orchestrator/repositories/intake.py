"""The run aggregate's intake: the one way a run enters it (a queued run with its run.queued
event), and the reads admission needs of it: the run a claim points at (its duplicate table,
a retry), the run a retry names, and whether a message still has a run (its retention).

This module is the sanctioned exception to "nothing outside the orchestrator writes the run
aggregate": admission calls it inside its own statement or transaction, because the spec puts
the inbound claim and the run it creates in one transaction. What a queued run is (its status,
first attempt, event, stored format, whether it heads its session) is written here alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

from sqlalchemy import (
    CTE,
    BigInteger,
    ColumnElement,
    Double,
    Integer,
    Select,
    SmallInteger,
    Text,
    and_,
    bindparam,
    case,
    cast,
    exists,
    func,
    insert,
    literal,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from services.orchestrator.repositories.transitions import (
    EVENT_COUNT,
    appended_events,
    event_params,
)
from tether import formats
from tether.db.schema import (
    in_state,
    messages,
    runs,
    sessions,
    tenant_queues,
    tenant_stripes,
    tenants,
)
from tether.domain import Run, run_queued
from tether.domain.channels import pinned_channel
from tether.errors import NotFound
from tether.priorities import NORMAL, PRIORITIES
from tether.states import RunStatus
from tether.visibility import Viewer


def head_if_idle(run_id: Any) -> Any:
    """The session's head once run `run_id` (a bound parameter) is admitted: an idle session
    makes it its head (`sessions.active_run_id`); a busy one keeps its head and the run queues
    behind it."""
    return func.coalesce(sessions.c.active_run_id, run_id)


# The facts a queued run is made of, in this order, as the source of `queued_run` selects them.
FACTS = (
    "run_id",
    "tenant_id",
    "session_id",
    "message_id",
    "conversation_id",
    "channel",
    "input_text",
    "max_attempts",
    "parent_run_id",
    "root_run_id",
    "traceparent",
    "session_head",
    "owner_principal_id",
    "visibility",
)


_FAIR_TENANT = bindparam("fq_tenant_id", type_=Text)
# A tenant's finish tag is striped over this many rows (tenant_stripes): its admissions take
# tags from different stripes at once, so as many admissions of one tenant as this go on
# without waiting for each other's commits.
STRIPES = 16
# The queue's virtual time: the least start tag of a claimable run not leased before (one scan
# of ix_runs_fair, past the runs queued again: a run refused by the model rate limit, retried or
# resumed keeps its tag, but its turn was served, and a newcomer starting level with it would
# go ahead of every run not yet leased); with none queued, the latest finish tag of any tenant
# (one probe of ix_tenant_stripes_tail), so that a tenant busy long ago starts level with the
# rest, not behind them.
_VIRTUAL_TIME = func.coalesce(
    select(runs.c.fair_key)
    .where(
        in_state(runs.c.status, RunStatus.QUEUED), runs.c.session_head, runs.c.started_at.is_(None)
    )
    .order_by(runs.c.fair_key)
    .limit(1)
    .scalar_subquery(),
    select(func.max(tenant_stripes.c.tail)).scalar_subquery(),
    literal(0.0, Double),
)
# The virtual time and the tenant's weight (tenants.weight, 1 when unset), read once.
_CLOCK = select(
    _VIRTUAL_TIME.label("vt"),
    cast(
        func.coalesce(
            select(tenants.c.weight).where(tenants.c.tenant_id == _FAIR_TENANT).scalar_subquery(),
            1,
        ),
        Double,
    ).label("w"),
).cte("fair_clock")


def _stride(clock: Any) -> Any:
    """One run's worth of a stripe's tags: STRIPES runs of the tenant, 1 / weight each."""
    return literal(float(STRIPES), Double) / clock.c.w


_STRIDE = _stride(_CLOCK)


def _offer(stripe: Any, clock: Any = _CLOCK) -> Any:
    """A stripe's next tag: its tail, or, when the virtual time has passed it, the first tag of
    the stripe's from the virtual time on (in the tenant's units u = vt * weight: the least
    u + d, 0 <= d < STRIPES, with u + d = the stripe's number modulo STRIPES). The stripes'
    first tags past the virtual time are the tenant's next STRIPES tags, the least within one
    run's tag of it."""
    u = clock.c.vt * clock.c.w
    behind = cast(stripe.c.stripe, Double) - u
    stripes = literal(float(STRIPES), Double)
    first = (u + behind - stripes * func.floor(behind / stripes)) / clock.c.w
    return func.greatest(stripe.c.tail, first)


# The run's start tag (start-time fair queueing), in this order:
# - the tenant's free stripe with the least next tag, locked without waiting (SKIP LOCKED: a
#   stripe another admission holds is left to it), the stripe's tail moving on by _STRIDE;
_PICK = (
    select(tenant_stripes.c.tenant_id, tenant_stripes.c.stripe)
    .select_from(tenant_stripes.join(_CLOCK, true()))
    .where(tenant_stripes.c.tenant_id == _FAIR_TENANT)
    .order_by(_offer(tenant_stripes), tenant_stripes.c.stripe)
    .limit(1)
    .with_for_update(skip_locked=True, of=tenant_stripes)
    .cte("fair_pick")
)
# The clock read in scalar subqueries (in an upsert's SET and RETURNING).
_CLOCK_READ = SimpleNamespace(
    c=SimpleNamespace(
        vt=select(_CLOCK.c.vt).scalar_subquery(), w=select(_CLOCK.c.w).scalar_subquery()
    )
)


def _moved_on(source: Select[Any], name: str, *, unless_moved: bool = False) -> CTE:
    """The stripe `source` selects (tenant_id, stripe, tail) moved on by one run: an upsert on
    the existing row (an UPDATE would take the admission's `tenant_id` parameter as a value
    to SET), returning the run's start tag. `unless_moved`: only while its tail is still the
    one `source` read (else nothing, and no row comes back)."""
    upsert = pg_insert(tenant_stripes).from_select(["tenant_id", "stripe", "tail"], source)
    return (
        upsert.on_conflict_do_update(
            index_elements=[tenant_stripes.c.tenant_id, tenant_stripes.c.stripe],
            set_={"tail": _offer(tenant_stripes, _CLOCK_READ) + _stride(_CLOCK_READ)},
            where=(tenant_stripes.c.tail == upsert.excluded.tail) if unless_moved else None,
        )
        .returning((tenant_stripes.c.tail - _stride(_CLOCK_READ)).label("start"))
        .cte(name)
    )


# The picked stripe's tail as this statement's snapshot has it. The pick chose by it; but when
# another admission took the stripe and committed after the snapshot and before the pick's lock,
# the lock goes to the row as it is now (PostgreSQL re-reads a row updated meanwhile, and the
# pick's own columns with it), whose next tag is a round of stripes on while a lower one may be
# free. The stripe is then left as it is, and the run retagged (`retag`, a new snapshot).
_AS_READ = tenant_stripes.alias("stripe_as_read")
_TAIL_AS_READ = (
    select(_AS_READ.c.tail)
    .where(_AS_READ.c.tenant_id == _PICK.c.tenant_id, _AS_READ.c.stripe == _PICK.c.stripe)
    .scalar_subquery()
)
_TAKEN = _moved_on(
    select(_PICK.c.tenant_id, _PICK.c.stripe, _TAIL_AS_READ), "fair_taken", unless_moved=True
)
# - when every stripe is held (more admissions of the tenant at once than STRIPES), the one
#   with the least next tag, waiting for it;
_LEAST = tenant_stripes.alias("least_stripe")
_WAITED = _moved_on(
    select(_LEAST.c.tenant_id, _LEAST.c.stripe, literal(0.0, Double))
    .select_from(_LEAST.join(_CLOCK, true()))
    .where(_LEAST.c.tenant_id == _FAIR_TENANT, ~exists(select(_PICK.c.stripe)))
    .order_by(_offer(_LEAST), _LEAST.c.stripe)
    .limit(1),
    "fair_waited",
)
# - the tenant's first run: its stripes are made, the first of them taken (and its row in
#   tenant_queues, which a claim locks when the tenant has a cap). Two first runs at once: the
#   later finds the stripes made by the other and starts at the virtual time.
_NO_STRIPES = ~exists(
    select(tenant_stripes.c.stripe).where(tenant_stripes.c.tenant_id == _FAIR_TENANT)
)
_UNITS = func.ceil(_CLOCK.c.vt * _CLOCK.c.w)
_NUMBERS = (
    func.generate_series(0, STRIPES - 1).table_valued("n").render_derived(name="stripe_numbers")
)
_MADE = (
    pg_insert(tenant_stripes)
    .from_select(
        ["tenant_id", "stripe", "tail"],
        select(
            tenants.c.tenant_id,
            _NUMBERS.c.n,
            case(
                (
                    _NUMBERS.c.n == func.mod(cast(_UNITS, BigInteger), STRIPES),
                    _UNITS / _CLOCK.c.w + _STRIDE,
                ),
                else_=literal(0.0, Double),
            ),
        )
        .select_from(tenants.join(_NUMBERS, true()).join(_CLOCK, true()))
        .where(tenants.c.tenant_id == _FAIR_TENANT, _NO_STRIPES),
    )
    .on_conflict_do_nothing()
    .returning(tenant_stripes.c.tail)
    .cte("fair_made")
)
_QUEUE_ROW = (
    pg_insert(tenant_queues)
    .from_select(
        ["tenant_id"],
        select(tenants.c.tenant_id).where(tenants.c.tenant_id == _FAIR_TENANT, _NO_STRIPES),
    )
    .on_conflict_do_nothing()
    .returning(tenant_queues.c.tenant_id)
    .cte("fair_queue_row")
)
_START = func.coalesce(
    select(_TAKEN.c.start).scalar_subquery(),
    select(_WAITED.c.start).scalar_subquery(),
    select(func.max(_MADE.c.tail - _STRIDE))
    .select_from(_MADE.join(_CLOCK, true()))
    .scalar_subquery(),
    select(_CLOCK.c.vt).scalar_subquery(),
)
# Whether the run's tag fell through to the virtual time: it was one of its tenant's first runs
# admitted at once, and another admission made the stripes, which this statement, having waited
# for that one to commit, could not see; or the stripe it picked moved before it locked it. The
# caller then has `retag` take it a tag (one more statement, for these runs only); left at the
# virtual time, a burst of a new tenant's first runs would all share one tag and go ahead of
# every other tenant's.
_TOOK = or_(exists(select(_TAKEN.c.start)), exists(select(_WAITED.c.start)))
RACED = and_(~_TOOK, ~exists(select(_MADE.c.tail))).label("fair_raced")
_RETAG = (
    update(runs)
    .where(runs.c.run_id == bindparam("rt_run_id"))
    .values(
        fair_key=func.coalesce(
            select(_TAKEN.c.start).scalar_subquery(),
            select(_WAITED.c.start).scalar_subquery(),
            select(_CLOCK.c.vt).scalar_subquery(),
        )
    )
    .returning(runs.c.fair_key, _TOOK.label("took"))
)
# How many times `retag` tries again when the stripe it picked moved before it locked it.
RETAGS = 3


async def retag(conn: AsyncConnection, run: Run) -> Run:
    """`run` (just queued, its statement RACED) with a start tag taken from its tenant's
    stripes, now that the admission that made them committed."""
    for _ in range(RETAGS):
        row = (
            await conn.execute(_RETAG, {"rt_run_id": run.run_id, "fq_tenant_id": run.tenant_id})
        ).one()
        if row.took:
            break
    return replace(run, fair_key=row.fair_key)


def queued_run(source: Select[Any]) -> tuple[CTE, CTE]:
    """The insert of a queued run whose facts `source` selects (FACTS, in order), with its
    priority and its start tag among every tenant's runs (its tenant's tags move on), and the
    insert of its run.queued event (seq 1): CTEs for one statement. Bind `queued_params`."""
    run = (
        insert(runs)
        .from_select(
            [*FACTS, "status", "attempt", "last_seq", "format", "priority", "fair_key"],
            source.add_columns(
                literal(RunStatus.QUEUED.value, Text),
                literal(1, Integer),
                EVENT_COUNT.cast(BigInteger),
                literal(formats.CURRENT, SmallInteger),
                bindparam("fq_priority", type_=SmallInteger),
                _START,
            ),
        )
        .returning(*runs.c)
        .add_cte(_QUEUE_ROW)
        .cte("queued_run")
    )
    return run, appended_events(run)


def queued_params(
    reason: str, tenant_id: str, priority: int = PRIORITIES[NORMAL]
) -> dict[str, Any]:
    """The bound values `queued_run` takes: its event's, and the tenant and priority (its rank)
    its start tag is taken for."""
    return {
        **event_params([run_queued(1, reason)]),
        "fq_tenant_id": tenant_id,
        "fq_priority": priority,
    }


def _bound(name: str, type_: Any = Text) -> Any:
    # Prefixed: an UPDATE in the statement would take a parameter named like one of its
    # table's columns (session_id, tenant_id, ...) as a value to SET.
    return bindparam(f"q_{name}", type_=type_)


_SET_HEAD = (
    update(sessions)
    .where(sessions.c.session_id == _bound("session_id"))
    .values(active_run_id=head_if_idle(_bound("run_id")))
    .returning(sessions.c.active_run_id)
    .cte("head")
)
_RUN, _QUEUED = queued_run(
    select(
        *[_bound(name) for name in FACTS[:7]],
        _bound("max_attempts", Integer),
        *[_bound(name) for name in FACTS[8:11]],
        _SET_HEAD.c.active_run_id == _bound("run_id"),
        *[_bound(name) for name in FACTS[12:]],
    ).select_from(_SET_HEAD)
)
_CREATE = select(_RUN, RACED).add_cte(_QUEUED)


async def create_queued_run(conn: AsyncConnection, facts: dict[str, Any], *, reason: str) -> Run:
    """Create a queued run of an existing session (`facts`: FACTS but `session_head`), heading
    it when the session is idle, with its run.queued event; one statement, in the caller's
    transaction."""
    params = {
        **{f"q_{k}": v for k, v in facts.items()},
        **queued_params(reason, facts["tenant_id"]),
    }
    row = (await conn.execute(_CREATE, params)).one()
    run = Run.from_row(row._mapping)
    return await retag(conn, run) if row.fair_raced else run


# A child run's channel: its runs are routed to the child's agent (pinned, as a channel
# connection's are), never to the tenant's routes.
CHILD_CHANNEL = "delegate"


async def create_child_run(
    conn: AsyncConnection,
    parent: Run,
    *,
    run_id: str,
    session_id: str,
    message_id: str,
    tool_call_id: str,
    agent: str,
    text: str,
    budget: Mapping[str, float] | None = None,
) -> Run:
    """Create the queued child run of `parent`'s delegate call `tool_call_id`: a run of
    `agent` in the parent's tenant and principal, heading a session of its own (the child's
    conversation, `delegate` channel, pinned to `agent`), its input `text`, placed in the
    parent's tree with `budget`, its share of what the parent had left. In the caller's
    transaction, which holds the parent; a second child of the
    same call is refused by ux_runs_tree_call.

    The session and message rows are admission's tables written here, as admission writes the
    run aggregate through this module: the one sanctioned crossing, both ways, so a child and
    everything it needs commit with its parent's `child.started`."""
    owner = parent.owner_principal_id or ""
    await conn.execute(
        insert(sessions).values(
            session_id=session_id,
            tenant_id=parent.tenant_id,
            channel=CHILD_CHANNEL,
            conversation_id=run_id,
            actor_scope=f"task:{owner}",
        )
    )
    await conn.execute(
        insert(messages).values(
            message_id=message_id,
            tenant_id=parent.tenant_id,
            session_id=session_id,
            source=CHILD_CHANNEL,
            event_id=f"{parent.run_id}:{tool_call_id}",
            actor_type="system",
            actor_id=owner,
            text=text,
        )
    )
    await create_queued_run(
        conn,
        {
            "run_id": run_id,
            "tenant_id": parent.tenant_id,
            "session_id": session_id,
            "message_id": message_id,
            "conversation_id": run_id,
            "channel": pinned_channel(CHILD_CHANNEL, agent),
            "input_text": text,
            "max_attempts": parent.max_attempts,
            "parent_run_id": None,
            "root_run_id": run_id,
            "traceparent": parent.traceparent,
            "owner_principal_id": parent.owner_principal_id,
            "visibility": parent.visibility,
        },
        reason="delegated",
    )
    row = (
        await conn.execute(
            update(runs)
            .where(runs.c.run_id == run_id)
            .values(
                tree_parent_run_id=parent.run_id,
                tree_call_id=tool_call_id,
                tree_root_run_id=parent.tree_root_run_id or parent.run_id,
                tree_depth=parent.tree_depth + 1,
                tree_budget=None if budget is None else dict(budget),
            )
            .returning(runs)
        )
    ).one()
    return Run.from_row(row._mapping)


_RUN_BY_ID = select(runs).where(runs.c.run_id == bindparam("run_id"))
# FOR KEY SHARE: the run cannot be removed (retention) while a retry of it is inserted.
_RUN_BY_ID_HELD = _RUN_BY_ID.with_for_update(read=True, key_share=True)


async def claimed_run(conn: AsyncConnection, run_id: str, *, hold: bool = False) -> Run:
    """The run an inbound claim points at (the claim and its run commit together); NotFound
    when retention removed it since the claim was read. `hold` keeps it from being removed
    until the transaction ends (a retry names it as its parent)."""
    stmt = _RUN_BY_ID_HELD if hold else _RUN_BY_ID
    row = (await conn.execute(stmt, {"run_id": run_id})).first()
    if row is None:
        raise NotFound(f"run {run_id!r} not found")
    return Run.from_row(row._mapping)


async def visible_run(conn: AsyncConnection, viewer: Viewer, run_id: str) -> Run:
    """The run a caller names (to retry it), or NotFound when it is absent or not the
    viewer's to see (the same answer)."""
    row = (await conn.execute(select(runs).where(runs.c.run_id == run_id, viewer.sees()))).first()
    if row is None:
        raise NotFound(f"run {run_id!r} not found")
    return Run.from_row(row._mapping)


_RETRIES = runs.alias("retries")
# The run's lineage from it on: each run that retried the one before, to the latest.
_LINEAGE = (
    select(runs.c.run_id, literal(0).label("depth"))
    .where(runs.c.run_id == bindparam("run_id"))
    .cte("lineage", recursive=True)
)
_LINEAGE = _LINEAGE.union_all(
    select(_RETRIES.c.run_id, _LINEAGE.c.depth + 1).where(
        _RETRIES.c.parent_run_id == _LINEAGE.c.run_id
    )
)
_LATEST_RETRY = (
    select(runs)
    .join(_LINEAGE, _LINEAGE.c.run_id == runs.c.run_id)
    .order_by(_LINEAGE.c.depth.desc())
    .limit(1)
)


async def latest_retry(conn: AsyncConnection, run_id: str) -> Run:
    """The latest run of the lineage from `run_id` on: the run that retried it, or the one
    that retried that, and so on (the run itself when none did)."""
    row = (await conn.execute(_LATEST_RETRY, {"run_id": run_id})).one()
    return Run.from_row(row._mapping)


def message_has_run(message_id: ColumnElement[Any]) -> ColumnElement[bool]:
    """Whether a run names the message `message_id` (an expression): admission keeps it."""
    return exists().where(runs.c.message_id == message_id)
