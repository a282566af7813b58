"""Removing runs: a terminal run past its tenant's retention with its whole aggregate, whole tool
outputs past theirs, and every run of a tenant being deleted.

Each removal is two statements in one transaction: the first picks and locks a bounded batch
(FOR UPDATE SKIP LOCKED: a run someone holds is left for a later pass), the second checks
again, in a snapshot taken after the locks were granted, what must keep a run, and removes the
rest with everything that names it. A run another run retried is removed after that run (its
`parent_run_id` names it); a run a live conversation's next run reads as history stays. The
run's claim becomes its tombstone and its interactions go with it, by their foreign keys
(migration 0013), in the same statement.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    CTE,
    Float,
    Interval,
    Select,
    Text,
    bindparam,
    case,
    delete,
    exists,
    func,
    or_,
    select,
    tuple_,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncConnection

from services.orchestrator.repositories.history import HISTORY_RUNS, read_as_history
from tether import audit
from tether.db.schema import (
    attempts,
    deliveries,
    effects,
    keyed_runs,
    run_events,
    run_keys,
    run_parts,
    runs,
    sessions,
    tool_outputs,
    usage_turns,
)
from tether.retention import Key, walk_params
from tether.states import TERMINAL

_TERMINAL = [s.value for s in TERMINAL]
_KEEP = bindparam("keep", type_=Interval)
_AFTER = tuple_(bindparam("after_at"), bindparam("after_id"))
_IDS = bindparam("run_ids", type_=ARRAY(Text))


def _finished_before_cutoff() -> Select[Any]:
    """A tenant's finished runs after the walk's key and past the cutoff, oldest first."""
    return (
        select(runs.c.run_id, runs.c.finished_at)
        .where(
            runs.c.tenant_id == bindparam("tenant_id"),
            runs.c.finished_at.is_not(None),
            tuple_(runs.c.finished_at, runs.c.run_id) > _AFTER,
            runs.c.finished_at < func.now() - _KEEP,
        )
        .order_by(runs.c.finished_at, runs.c.run_id)
        .limit(bindparam("batch"))
    )


_EXPIRED = _finished_before_cutoff().with_for_update(skip_locked=True)

# The seconds until the first finished run after a key expires.
_NEXT_EXPIRY = (
    select(func.extract("epoch", runs.c.finished_at + _KEEP - func.now()).cast(Float))
    .where(
        runs.c.tenant_id == bindparam("tenant_id"),
        runs.c.finished_at.is_not(None),
        tuple_(runs.c.finished_at, runs.c.run_id) > _AFTER,
    )
    .order_by(runs.c.finished_at, runs.c.run_id)
    .limit(1)
)

_RETRIED = exists().where(runs.alias("retry").c.parent_run_id == runs.c.run_id)


def _conversation_live() -> Any:
    """The run's conversation is live: a run of it still to go (its session has a head), or
    one created within `conversations` (an interval)."""
    latest = run_keys.alias("latest")
    newest = (
        select(func.max(latest.c.created_at))
        .where(latest.c.session_id == runs.c.session_id)
        .scalar_subquery()
    )
    # A scalar subquery, not EXISTS: one probe of the session per run examined (the planner
    # may hash an EXISTS, reading every session with a head for a batch of a few hundred).
    head = (
        select(sessions.c.active_run_id)
        .where(sessions.c.session_id == runs.c.session_id)
        .scalar_subquery()
    )
    headed = head.is_not(None)
    return or_(headed, newest > func.now() - bindparam("conversations", type_=Interval))


# The locked runs that may go: terminal, past the cutoff (checked again: the lock waited), not
# retried by a run still kept, and not what a live conversation's next run reads. The history
# check comes first (CASE keeps the order): it is bounded by the history's length.
_DOOMED_BY_POLICY = (
    select(runs.c.run_id)
    .where(
        runs.c.run_id == func.any(_IDS),
        runs.c.status.in_(_TERMINAL),
        runs.c.finished_at < func.now() - _KEEP,
        ~_RETRIED,
        case((read_as_history(runs), ~_conversation_live()), else_=True),
    )
    .cte("doomed")
)

# Every locked run of the tenant but one another run retried (it goes in a later batch).
_DOOMED_BY_DELETION = (
    select(runs.c.run_id)
    .where(runs.c.run_id == func.any(_IDS), runs.c.tenant_id == bindparam("tenant_id"), ~_RETRIED)
    .cte("doomed")
)


def _removal(doomed: CTE) -> Select[Any]:
    """Remove the `doomed` runs with everything of their aggregate, in one statement; the
    removed runs' ids come back."""
    ids = select(doomed.c.run_id)
    children = [
        delete(table).where(table.c.run_id.in_(ids)).cte(f"gone_{table.name}")
        for table in (
            run_events,
            run_parts,
            attempts,
            usage_turns,
            effects,
            tool_outputs,
            deliveries,
        )
    ]
    gone = delete(runs).where(runs.c.run_id.in_(ids)).returning(runs.c.run_id).cte("gone")
    stmt = select(gone.c.run_id)
    for child in children:
        stmt = stmt.add_cte(child)
    return stmt


_REMOVE_EXPIRED = _removal(_DOOMED_BY_POLICY)
_REMOVE_DELETED = _removal(_DOOMED_BY_DELETION)

# A tenant's runs to delete, leaves of the retry lineage first (by its keys, `run_keys`).
_TENANT_RUNS = (
    select(runs.c.run_id)
    .select_from(keyed_runs())
    .where(run_keys.c.tenant_id == bindparam("tenant_id"), ~_RETRIED)
    .limit(bindparam("batch"))
    .with_for_update(of=runs, skip_locked=True)
)

_TOOL_OUTPUTS_EXAMINED = _finished_before_cutoff().cte("examined")
_REMOVE_TOOL_OUTPUTS = select(
    select(func.count())
    .select_from(
        delete(tool_outputs)
        .where(tool_outputs.c.run_id.in_(select(_TOOL_OUTPUTS_EXAMINED.c.run_id)))
        .returning(tool_outputs.c.output_ref)
        .cte("gone_outputs")
    )
    .scalar_subquery()
    .label("removed"),
    select(func.count()).select_from(_TOOL_OUTPUTS_EXAMINED).scalar_subquery().label("examined"),
    select(_TOOL_OUTPUTS_EXAMINED.c.finished_at)
    .order_by(_TOOL_OUTPUTS_EXAMINED.c.finished_at.desc(), _TOOL_OUTPUTS_EXAMINED.c.run_id.desc())
    .limit(1)
    .scalar_subquery()
    .label("last_at"),
    select(_TOOL_OUTPUTS_EXAMINED.c.run_id)
    .order_by(_TOOL_OUTPUTS_EXAMINED.c.finished_at.desc(), _TOOL_OUTPUTS_EXAMINED.c.run_id.desc())
    .limit(1)
    .scalar_subquery()
    .label("last_id"),
)


async def lock_expired_runs(
    conn: AsyncConnection, tenant_id: str, keep_s: float, after: Key | None, batch: int
) -> list[tuple[datetime, str]]:
    """Lock up to `batch` of the tenant's runs that finished more than `keep_s` ago, oldest
    first after the key `after`; their keys (a run someone holds is skipped)."""
    rows = await conn.execute(_EXPIRED, walk_params(tenant_id, keep_s, after, batch))
    return [(row.finished_at, row.run_id) for row in rows]


async def remove_expired_runs(
    conn: AsyncConnection, run_ids: Sequence[str], keep_s: float, conversations_s: float
) -> list[str]:
    """Remove those of the locked `run_ids` that may go under the policy, with their whole
    aggregate and audit records; the ids removed. A run kept is still needed: not terminal,
    retried by a run still kept, or read as history by a live conversation's next run."""
    params = {
        "run_ids": list(run_ids),
        "keep": timedelta(seconds=keep_s),
        "conversations": timedelta(seconds=conversations_s),
        "limit_runs": HISTORY_RUNS,
    }
    removed = list((await conn.execute(_REMOVE_EXPIRED, params)).scalars())
    await audit.forget_runs(conn, removed)
    return removed


async def next_expiry_in(
    conn: AsyncConnection, tenant_id: str, keep_s: float, after: Key | None
) -> float | None:
    """The seconds until the tenant's first finished run after the key `after` is past
    `keep_s`; None when none finished after it."""
    params = walk_params(tenant_id, keep_s, after, 1)
    value = (await conn.execute(_NEXT_EXPIRY, params)).scalar()
    return None if value is None else float(value)


async def remove_tool_outputs(
    conn: AsyncConnection, tenant_id: str, keep_s: float, after: Key | None, batch: int
) -> tuple[int, int, Key | None]:
    """Remove the whole tool outputs of up to `batch` of the tenant's runs that finished more
    than `keep_s` ago, oldest first after the key `after`: (runs examined, outputs removed,
    the key of the last run examined)."""
    row = (
        await conn.execute(_REMOVE_TOOL_OUTPUTS, walk_params(tenant_id, keep_s, after, batch))
    ).one()
    last = None if row.last_id is None else (row.last_at, row.last_id)
    return int(row.examined), int(row.removed), last


async def delete_tenant_runs(conn: AsyncConnection, tenant_id: str, batch: int) -> int:
    """Remove up to `batch` of the tenant's runs, whatever their status, with their whole
    aggregate (a run another run retried waits for a later batch); how many were removed."""
    params = {"tenant_id": tenant_id, "batch": batch}
    locked = list((await conn.execute(_TENANT_RUNS, params)).scalars())
    if not locked:
        return 0
    removed = list(
        (await conn.execute(_REMOVE_DELETED, {"run_ids": locked, "tenant_id": tenant_id})).scalars()
    )
    await audit.forget_runs(conn, removed)
    return len(removed)


async def tenant_has_runs(conn: AsyncConnection, tenant_id: str) -> bool:
    """Whether any run of the tenant is left."""
    return bool(
        (await conn.execute(select(exists().where(run_keys.c.tenant_id == tenant_id)))).scalar()
    )
