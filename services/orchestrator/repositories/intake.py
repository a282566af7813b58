"""The run aggregate's intake: the one way a run enters it (a queued run with its run.queued
event), and the reads admission needs of it: the run a claim points at (its duplicate table,
a retry), the run a retry names, and whether a message still has a run (its retention).

This module is the sanctioned exception to "nothing outside the orchestrator writes the run
aggregate": admission calls it inside its own statement or transaction, because the spec puts
the inbound claim and the run it creates in one transaction. What a queued run is (its status,
first attempt, event, stored format, whether it heads its session) is written here alone.
"""

from __future__ import annotations

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
    bindparam,
    exists,
    func,
    insert,
    literal,
    select,
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
from tether.db.schema import in_state, runs, sessions, tenant_queues, tenants
from tether.domain import Run, run_queued
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
# The queue's virtual time: the least start tag of a claimable run (one probe of ix_runs_fair);
# with none queued, the latest finish tag of any tenant (one probe of ix_tenant_queues_tail), so
# that a tenant busy long ago starts level with the rest, not behind them.
_VIRTUAL_TIME = func.coalesce(
    select(runs.c.fair_key)
    .where(in_state(runs.c.status, RunStatus.QUEUED), runs.c.session_head)
    .order_by(runs.c.fair_key)
    .limit(1)
    .scalar_subquery(),
    select(func.max(tenant_queues.c.tail)).scalar_subquery(),
    literal(0.0, Double),
)
# What one run costs its tenant's tags: 1 / weight (tenants.weight, 1 when unset).
_STEP = literal(1.0, Double) / func.coalesce(
    select(tenants.c.weight).where(tenants.c.tenant_id == _FAIR_TENANT).scalar_subquery(), 1
)
# The run's start tag (start-time fair queueing): the later of its tenant's finish tag and the
# virtual time; its tenant's finish tag moves on by one step. One row per tenant, locked for
# the admitting statement only.
_FAIR = (
    pg_insert(tenant_queues)
    .values(tenant_id=_FAIR_TENANT, tail=_VIRTUAL_TIME + _STEP)
    .on_conflict_do_update(
        index_elements=[tenant_queues.c.tenant_id],
        set_={"tail": func.greatest(tenant_queues.c.tail, _VIRTUAL_TIME) + _STEP},
    )
    .returning((tenant_queues.c.tail - _STEP).label("start"))
    .cte("fair")
)


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
                select(_FAIR.c.start).scalar_subquery(),
            ),
        )
        .returning(*runs.c)
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
_CREATE = select(_RUN).add_cte(_QUEUED)


async def create_queued_run(conn: AsyncConnection, facts: dict[str, Any], *, reason: str) -> Run:
    """Create a queued run of an existing session (`facts`: FACTS but `session_head`), heading
    it when the session is idle, with its run.queued event; one statement, in the caller's
    transaction."""
    params = {
        **{f"q_{k}": v for k, v in facts.items()},
        **queued_params(reason, facts["tenant_id"]),
    }
    row = (await conn.execute(_CREATE, params)).one()
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
