"""Reads of runs, their event log and execution record (attempts, model turns, lineage; parts:
`parts`), and the cancel flag on a running run."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    and_,
    bindparam,
    case,
    false,
    func,
    literal,
    literal_column,
    or_,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.ext.asyncio import AsyncConnection

from services.orchestrator.repositories import parts as parts_repo
from services.orchestrator.repositories.answers import READ_RUN
from services.orchestrator.repositories.transitions import LEASE_HELD
from tether import formats
from tether.db.schema import (
    attempts,
    keyed_runs,
    routings,
    run_event_log,
    run_keys,
    runs,
    usage_turns,
)
from tether.domain import Attempt, LoggedEvent, ModelTurn, PricedTurn, Run, RunRouting
from tether.errors import InvalidArgument, NotFound, StaleLease
from tether.ids import is_identifier
from tether.pricing import TOKEN_FIELDS, Price
from tether.states import RunStatus
from tether.visibility import Viewer

# The usage a run is shown with: the total stored when it ended; before that (queued, running,
# parked) the sum of its turns priced so far, what it has cost already (as the run page's
# usage.updated total says). CASE evaluates the sum only for a run without a stored total.
_TURNS_SO_FAR = (
    select(
        func.jsonb_build_object(
            *[
                arg
                for k in (*TOKEN_FIELDS, "cost_micros")
                for arg in (literal(k), func.coalesce(func.sum(usage_turns.c[k]), 0))
            ],
            type_=JSONB,
        )
    )
    .where(usage_turns.c.run_id == runs.c.run_id)
    .scalar_subquery()
)
# A run as readers show it (`READ_RUN`: its answer where it is stored, as its parts when it is
# stored by reference), with its usage so far.
SHOWN_RUN = (
    *[c for c in READ_RUN if c.name != "usage"],
    case((runs.c.usage == literal_column("'{}'::jsonb"), _TURNS_SO_FAR), else_=runs.c.usage).label(
        "usage"
    ),
)


async def _find_run(
    conn: AsyncConnection,
    run_id: str,
    where: ColumnElement[bool],
    *,
    lock: bool = False,
    columns: Sequence[Any] = (runs,),
) -> Run:
    stmt = select(*columns).where(runs.c.run_id == run_id, where)
    if lock:
        # FOR NO KEY UPDATE: writers of the run wait; inserts referencing it (parts,
        # interactions) do not.
        stmt = stmt.with_for_update(key_share=True)
    row = (await conn.execute(stmt)).first()
    if row is None:
        raise NotFound(f"run {run_id!r} not found")
    return Run.from_row(row._mapping)


async def get_run(conn: AsyncConnection, tenant_id: str, run_id: str) -> Run:
    """The run, or NotFound when it is absent or another tenant's (the same answer)."""
    return await _find_run(conn, run_id, runs.c.tenant_id == tenant_id, columns=READ_RUN)


async def visible_run(
    conn: AsyncConnection, viewer: Viewer, run_id: str, *, lock: bool = False
) -> Run:
    """The run, or NotFound when it is absent or not the viewer's to see (the same answer).
    `lock` holds the row until the transaction ends, so its status cannot move under a
    read-then-write. Its usage is what it has cost so far (`SHOWN_RUN`)."""
    return await _find_run(conn, run_id, viewer.sees(), lock=lock, columns=SHOWN_RUN)


async def visible_run_facts(
    conn: AsyncConnection, viewer: Viewer, run_id: str, held_epoch: int | None
) -> tuple[Run, bool]:
    """The run and `lease_held`: whether it is running under `held_epoch` now, by the one lease
    fence (false when `held_epoch` is None); NotFound when it is absent or not the viewer's to
    see (the same answer)."""
    stmt = select(*READ_RUN, func.coalesce(LEASE_HELD, false()).label("lease_held")).where(
        runs.c.run_id == run_id, viewer.sees()
    )
    row = (await conn.execute(stmt, {"held_epoch": held_epoch})).first()
    if row is None:
        raise NotFound(f"run {run_id!r} not found")
    return Run.from_row(row._mapping), bool(row.lease_held)


_LEASED = select(runs).where(runs.c.run_id == bindparam("r_run_id"), LEASE_HELD)


async def leased_run(conn: AsyncConnection, run_id: str, epoch: int, *, lock: bool = False) -> Run:
    """The run while `epoch` is its live lease; StaleLease when it is absent, no longer running
    or leased again (the holder of `epoch` must stop). `lock` holds the row to the end of the
    transaction, so a decision made on it stands until the move that follows."""
    stmt = _LEASED.with_for_update() if lock else _LEASED
    row = (await conn.execute(stmt, {"r_run_id": run_id, "held_epoch": epoch})).first()
    if row is None:
        raise StaleLease(f"lease epoch {epoch} of run {run_id} is not current")
    return Run.from_row(row._mapping)


_FLAG_CANCEL = (
    update(runs)
    .where(
        runs.c.run_id == bindparam("r_run_id"),
        runs.c.status == RunStatus.RUNNING.value,
        runs.c.cancel_requested_at.is_(None),
    )
    .values(cancel_requested_at=func.now())
    .returning(*runs.c)
)


_ROUTING = (
    select(func.coalesce(routings.c.config, runs.c.config))
    .select_from(runs.outerjoin(routings, routings.c.routing_id == runs.c.routing_id))
    .where(runs.c.run_id == bindparam("r_run_id"))
)


async def routing_of(conn: AsyncConnection, run_id: str) -> dict[str, Any]:
    """The routing decision the run's current attempt runs with, in its stored form (named in
    `routings`; whole on the row when a release before routings leased it); {} for none."""
    config = (await conn.execute(_ROUTING, {"r_run_id": run_id})).scalar()
    return dict(config or {})


async def pinned_routing(conn: AsyncConnection, run: Run) -> RunRouting | None:
    """The routing decision `run`'s current attempt runs with, under its name (`routing_of`);
    None before its first lease."""
    return _routing(run.routing_id, await routing_of(conn, run.run_id))


async def routed_prices(conn: AsyncConnection, run_id: str) -> dict[str, Price]:
    """The prices routing resolved for the run's current attempt, by model."""
    prices = (await routing_of(conn, run_id)).get("prices", {})
    return {model: Price(**price) for model, price in prices.items()}


async def flag_cancel(conn: AsyncConnection, run_id: str) -> Run | None:
    """Record a cancel request on a running run, for its worker to act on; None when it is not
    running or was flagged already."""
    row = (await conn.execute(_FLAG_CANCEL, {"r_run_id": run_id})).first()
    return None if row is None else Run.from_row(row._mapping)


async def read_events(
    conn: AsyncConnection, run_id: str, after_seq: int, limit: int
) -> list[LoggedEvent]:
    """Up to `limit` events with seq > after_seq, in order."""
    stmt = (
        select(run_event_log)
        .where(
            run_event_log.c.run_id == run_id,
            run_event_log.c.seq > after_seq,
            run_event_log.c.row_seq > after_seq,  # for the index (`run_event_log`)
        )
        .order_by(run_event_log.c.seq)
        .limit(limit)
    )
    return [LoggedEvent.from_row(row._mapping) for row in await conn.execute(stmt)]


_TURNS_AT = select(usage_turns).where(
    usage_turns.c.run_id == bindparam("run_id"),
    usage_turns.c.event_seq == func.any(bindparam("seqs", type_=ARRAY(BigInteger))),
)


async def filled_events(
    conn: AsyncConnection,
    run_id: str,
    events: Sequence[LoggedEvent],
    *,
    result_text: str | None,
    usage: Mapping[str, int],
) -> list[LoggedEvent]:
    """Run `run_id`'s stored `events` as their readers take them (`formats.fill`): those stored
    by reference filled in from the run's rows (its answer and `usage`, and what the run's
    parts and turns hold, each read in one indexed query when one is named)."""
    parts = await parts_repo.parts_at(conn, run_id, formats.referenced_parts(events))
    turns: dict[int, ModelTurn] = {}
    if seqs := formats.referenced_turns(events):
        rows = await conn.execute(_TURNS_AT, {"run_id": run_id, "seqs": seqs})
        turns = {row.event_seq: _turn(row._mapping) for row in rows}
    return [
        formats.fill(e, result_text=result_text, usage=usage, parts=parts, turns=turns)
        for e in events
    ]


def _turn(row: Mapping[Any, Any]) -> ModelTurn:
    return ModelTurn(
        row["model"], **{k: row[k] for k in TOKEN_FIELDS}, cost_micros=row["cost_micros"]
    )


def encode_page_token(created_at: datetime, run_id: str) -> str:
    """An opaque cursor after (created_at, run_id)."""
    return base64.urlsafe_b64encode(f"{created_at.isoformat()}|{run_id}".encode()).decode()


def decode_page_token(token: str) -> tuple[datetime, str]:
    forged = InvalidArgument("page_token is not one this service issued")
    try:
        created, run_id = base64.urlsafe_b64decode(token.encode()).decode().split("|", 1)
        created_at = datetime.fromisoformat(created)
    except (ValueError, binascii.Error, UnicodeDecodeError) as exc:
        raise forged from exc
    # Every token this service issues carries an aware time and a real run id; anything else
    # was made by hand and would reach PostgreSQL as a value it refuses.
    if created_at.tzinfo is None or not is_identifier(run_id):
        raise forged
    return created_at, run_id


async def search_runs(
    conn: AsyncConnection,
    viewer: Viewer,
    *,
    statuses: Sequence[RunStatus],
    conversation_id: str,
    page_size: int,
    page_token: str,
    created_after: datetime | None = None,
    tree_root_run_id: str = "",
) -> tuple[list[tuple[Run, RunRouting | None]], str]:
    """One page of the runs the viewer may see (created at or after `created_after` when
    given), newest first, each with the routing decision it is pinned to (None before its
    first lease) and its usage so far (`SHOWN_RUN`), and the next page's cursor."""
    columns: list[Any] = [
        *SHOWN_RUN,
        func.coalesce(routings.c.config, runs.c.config).label("routing_config"),
    ]
    # By the run's keys (`run_keys`: the viewer's tenant, or tenant and owner, newest first),
    # each run then by its id; who may see it is decided on the run's own row as well, not on
    # a copy of its owner alone.
    stmt = (
        select(*columns)
        .select_from(keyed_runs().outerjoin(routings, routings.c.routing_id == runs.c.routing_id))
        .where(viewer.sees(run_keys), viewer.sees())
    )
    if statuses:
        stmt = stmt.where(runs.c.status.in_([s.value for s in statuses]))
    if conversation_id:
        stmt = stmt.where(runs.c.conversation_id == conversation_id)
    if created_after is not None:
        stmt = stmt.where(run_keys.c.created_at >= created_after)
    if tree_root_run_id:
        # The root (its own root, unrecorded) and every run below it (ix_runs_tree_root).
        stmt = stmt.where(
            or_(runs.c.run_id == tree_root_run_id, runs.c.tree_root_run_id == tree_root_run_id)
        )
    if page_token:
        created_at, run_id = decode_page_token(page_token)
        stmt = stmt.where(
            or_(
                run_keys.c.created_at < created_at,
                and_(run_keys.c.created_at == created_at, run_keys.c.run_id < run_id),
            )
        )
    stmt = stmt.order_by(run_keys.c.created_at.desc(), run_keys.c.run_id.desc()).limit(
        page_size + 1
    )
    rows = (await conn.execute(stmt)).all()
    found = [
        (Run.from_row(row._mapping), _routing(row.routing_id, row.routing_config)) for row in rows
    ]
    if len(found) <= page_size:
        return found, ""
    last = found[page_size - 1][0]
    return found[:page_size], encode_page_token(last.created_at, last.run_id)


def _routing(routing_id: str | None, stored: Mapping[str, Any] | None) -> RunRouting | None:
    return RunRouting(routing_id or "", stored) if stored else None


_ATTEMPTS = (
    select(attempts)
    .where(attempts.c.run_id == bindparam("run_id"))
    .order_by(attempts.c.started_at, attempts.c.lease_epoch)
)
# A turn belongs to the attempt that had started when it was recorded.
_TURN_ATTEMPT = (
    select(attempts.c.attempt)
    .where(
        attempts.c.run_id == usage_turns.c.run_id, attempts.c.started_at <= usage_turns.c.created_at
    )
    .order_by(attempts.c.started_at.desc())
    .limit(1)
    .scalar_subquery()
)
_TURNS = (
    select(usage_turns, _TURN_ATTEMPT.label("attempt"))
    .where(usage_turns.c.run_id == bindparam("run_id"))
    .order_by(usage_turns.c.id)
)


async def attempts_of(conn: AsyncConnection, run_id: str) -> list[Attempt]:
    """The run's attempts, oldest first."""
    rows = await conn.execute(_ATTEMPTS, {"run_id": run_id})
    return [Attempt.from_row(row._mapping) for row in rows]


async def turns_of(conn: AsyncConnection, run_id: str) -> list[PricedTurn]:
    """The run's priced model turns, oldest first, each with the attempt it belongs to."""
    rows = await conn.execute(_TURNS, {"run_id": run_id})
    return [PricedTurn.from_row(row._mapping) for row in rows]


async def lineage_of(conn: AsyncConnection, viewer: Viewer, run: Run) -> list[Run]:
    """Every run of the run's lineage still kept, oldest first: its root and each retry after
    it (a lineage is one chain: a run is retried at most once, by compare-and-swap)."""
    chain = (
        select(runs.c.run_id, literal(0).label("depth"))
        .where(runs.c.run_id == run.root_run_id)
        .cte("chain", recursive=True)
    )
    retry = runs.alias("retry")
    chain = chain.union_all(
        select(retry.c.run_id, chain.c.depth + 1).where(retry.c.parent_run_id == chain.c.run_id)
    )
    stmt = (
        select(*READ_RUN)
        .join(chain, chain.c.run_id == runs.c.run_id)
        .where(viewer.sees())
        .order_by(chain.c.depth)
    )
    return [Run.from_row(row._mapping) for row in await conn.execute(stmt)]
