"""The run aggregate's intake: the one way a run enters it (a queued run, which its log reads as
its run.queued), and the reads admission needs of it: the run a claim points at (its duplicate
table, a retry), the run a retry names, and whether a message still has a run (its retention).

This module is the sanctioned exception to "nothing outside the orchestrator writes the run
aggregate": admission calls it inside its own statement or transaction, because the spec puts
the inbound claim and the run it creates in one transaction. What a queued run is (its status,
first attempt, event, stored format, whether it heads its session) is written here alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import (
    CTE,
    BigInteger,
    ColumnElement,
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
from sqlalchemy.ext.asyncio import AsyncConnection

from services.orchestrator.repositories.answers import READ_RUN

# RACED and retag are admission's too (it may import the intake alone of the orchestrator).
from services.orchestrator.repositories.fair_tags import CAPPED, QUEUE_ROW, START
from services.orchestrator.repositories.fair_tags import RACED as RACED
from services.orchestrator.repositories.fair_tags import retag as retag
from tether import formats
from tether.db.schema import (
    messages,
    run_keys,
    runs,
    sessions,
)
from tether.domain import Run
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


def queued_run(source: Select[Any], more: tuple[str, ...] = ()) -> CTE:
    """The insert of a queued run whose facts `source` selects (FACTS, in order, then the
    columns `more` names), with its priority and its start tag among every tenant's runs (its
    tenant's tags move on): a CTE for one statement. Bind `queued_params`.

    Its run.queued (seq 1) is read from the row itself (`run_event_log`, migration 0048): the
    attempt is 1 and the reason is what its lineage says (a delegate call's child: delegated;
    a retried delivery, `parent_run_id`: redelivered; else admitted), so no event row is
    written with it."""
    return (
        insert(runs)
        .from_select(
            [
                *FACTS,
                *more,
                "status",
                "attempt",
                "last_seq",
                "format",
                "priority",
                "fair_key",
                "capped",
            ],
            source.add_columns(
                literal(RunStatus.QUEUED.value, Text),
                literal(1, Integer),
                literal(1, BigInteger),  # its run.queued, read from this row
                literal(formats.CURRENT, SmallInteger),
                bindparam("fq_priority", type_=SmallInteger),
                START,
                CAPPED,
            ),
        )
        .returning(*runs.c)
        .add_cte(QUEUE_ROW)
        .cte("queued_run")
    )


def queued_params(tenant_id: str, priority: int = PRIORITIES[NORMAL]) -> dict[str, Any]:
    """The bound values `queued_run` takes: the tenant and priority (its rank) its start tag is
    taken for."""
    return {"fq_tenant_id": tenant_id, "fq_priority": priority}


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
_RUN = queued_run(
    select(
        *[_bound(name) for name in FACTS[:7]],
        _bound("max_attempts", Integer),
        *[_bound(name) for name in FACTS[8:11]],
        _SET_HEAD.c.active_run_id == _bound("run_id"),
        *[_bound(name) for name in FACTS[12:]],
    ).select_from(_SET_HEAD)
)
_CREATE = select(_RUN, RACED)


async def create_queued_run(conn: AsyncConnection, facts: dict[str, Any]) -> Run:
    """Create a queued run of an existing session (`facts`: FACTS but `session_head`), heading
    it when the session is idle; one statement, in the caller's transaction."""
    params = {
        **{f"q_{k}": v for k, v in facts.items()},
        **queued_params(facts["tenant_id"]),
    }
    row = (await conn.execute(_CREATE, params)).one()
    run = Run.from_row(row._mapping)
    return await retag(conn, run) if row.fair_raced else run


# A child run's channel: its runs are routed to the child's agent (pinned, as a channel
# connection's are), never to the tenant's routes.
CHILD_CHANNEL = "delegate"


# A child run, in one statement: its session (which it heads: a child's session is new), its
# message, and the run with its place in the tree.
_TREE = ("tree_parent_run_id", "tree_call_id", "tree_root_run_id", "tree_depth", "tree_budget")
_CHILD_SESSION = (
    insert(sessions)
    .values(
        session_id=_bound("session_id"),
        tenant_id=_bound("tenant_id"),
        channel=CHILD_CHANNEL,
        conversation_id=_bound("run_id"),
        actor_scope=_bound("actor_scope"),
        active_run_id=_bound("run_id"),
    )
    .returning(sessions.c.session_id)
    .cte("child_session")
)
_CHILD_MESSAGE = (
    insert(messages)
    .values(
        message_id=_bound("message_id"),
        tenant_id=_bound("tenant_id"),
        session_id=_bound("session_id"),
        source=CHILD_CHANNEL,
        event_id=_bound("event_id"),
        actor_type="system",
        actor_id=_bound("actor_id"),
        text=_bound("input_text"),
    )
    .returning(messages.c.message_id)
    .cte("child_message")
)
_CHILD_RUN = queued_run(
    select(
        *[_bound(name) for name in FACTS[:7]],
        _bound("max_attempts", Integer),
        *[_bound(name) for name in FACTS[8:11]],
        literal(True),
        *[_bound(name) for name in FACTS[12:]],
        *[_bound(name) for name in _TREE[:3]],
        _bound("tree_depth", Integer),
        bindparam("q_tree_budget", type_=runs.c.tree_budget.type),
    ).select_from(_CHILD_SESSION.join(_CHILD_MESSAGE, literal(True))),
    more=_TREE,
)
_CREATE_CHILD = select(_CHILD_RUN, RACED)


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
    facts = {
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
        "actor_scope": f"task:{owner}",
        "actor_id": owner,
        "event_id": f"{parent.run_id}:{tool_call_id}",
        "tree_parent_run_id": parent.run_id,
        "tree_call_id": tool_call_id,
        "tree_root_run_id": parent.tree_root_run_id or parent.run_id,
        "tree_depth": parent.tree_depth + 1,
        "tree_budget": None if budget is None else dict(budget),
    }
    params = {
        **{f"q_{k}": v for k, v in facts.items()},
        **queued_params(parent.tenant_id),
    }
    row = (await conn.execute(_CREATE_CHILD, params)).one()
    run = Run.from_row(row._mapping)
    return await retag(conn, run) if row.fair_raced else run


# A run as readers show it (its answer too when its parts hold it: `answers`).
_RUN_BY_ID = select(*READ_RUN).where(runs.c.run_id == bindparam("run_id"))
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
    row = (
        await conn.execute(select(*READ_RUN).where(runs.c.run_id == run_id, viewer.sees()))
    ).first()
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
    select(*READ_RUN)
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
    return exists().where(run_keys.c.message_id == message_id)
