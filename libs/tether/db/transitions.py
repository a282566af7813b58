"""Applies the state machine's transitions: one guarded UPDATE plus its events, one transaction.

Callers pass an open connection inside a transaction; the event rows are appended with
consecutive `seq` values taken from the same UPDATE that moved the run, so the log and the status
can never disagree.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Select, Text, Update, cast, insert, select, true, update
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql import func

from tether.db.schema import run_events, runs, sessions
from tether.states import Transition


@dataclass(frozen=True)
class Event:
    """A durable event to append: its stable type name and JSON payload."""

    type: str
    payload: Mapping[str, Any]


async def apply(
    conn: AsyncConnection,
    transition: Transition,
    run_id: str,
    *,
    events: Sequence[Event],
    epoch: int | None = None,
    tenant_id: str | None = None,
    values: Mapping[str, Any] | None = None,
    handed_over: list[str] | None = None,
) -> Row[Any] | None:
    """Move `run_id` along `transition`, appending `events`; None means it had already moved.

    A fenced transition also requires `lease_epoch = epoch`, so a worker whose lease was reaped
    cannot write. `tenant_id`, when given, scopes the move to the caller's tenant. A terminal
    move hands the session to its next queued message, whose run id goes into `handed_over`.
    """
    if transition.fenced and epoch is None:
        raise ValueError(f"transition {transition.name} needs the lease epoch")
    stmt = (
        update(runs)
        .where(runs.c.run_id == run_id, runs.c.status.in_([s.value for s in transition.sources]))
        .values(
            status=transition.target.value,
            updated_at=func.now(),
            last_seq=runs.c.last_seq + len(events),
            **dict(values or {}),
        )
        .returning(*runs.c)
    )
    if transition.fenced:
        stmt = stmt.where(runs.c.lease_epoch == epoch)
    if tenant_id is not None:
        stmt = stmt.where(runs.c.tenant_id == tenant_id)
    row = (await conn.execute(_with_events(stmt, events) if events else stmt)).first()
    if row is None:
        return None
    if transition.target.terminal:
        next_run = await hand_over_session(conn, row.session_id, run_id)
        if next_run is not None and handed_over is not None:
            handed_over.append(next_run)
    return row


def _with_events(move: Update, events: Sequence[Event]) -> Select[Any]:
    """`move` and the insert of its events as ONE statement (one round trip): the events take
    the seqs the move reserved, and are written only if the move matched."""
    moved = move.cte("moved")
    batch = (
        func.unnest(
            cast([e.type for e in events], ARRAY(Text)),
            cast([json.dumps(dict(e.payload)) for e in events], ARRAY(Text)),
        )
        .table_valued("type", "payload", with_ordinality="ord")
        .render_derived("e", with_types=False)
    )
    rows = select(
        moved.c.run_id,
        moved.c.last_seq - len(events) + batch.c.ord,
        batch.c.type,
        cast(batch.c.payload, JSONB),
    ).select_from(moved.join(batch, true()))
    appended = insert(run_events).from_select(["run_id", "seq", "type", "payload"], rows)
    return select(moved).add_cte(appended.cte("appended"))


async def hand_over_session(conn: AsyncConnection, session_id: str, run_id: str) -> str | None:
    """If `run_id` heads its session, make the oldest queued message the head (or none).

    The session row is locked first, in its own statement, so the search for the next run
    sees every run admitted before the lock was granted (admission takes the same lock): no
    message is ever left queued behind a head that is gone.
    """
    locked = (
        await conn.execute(
            select(sessions.c.active_run_id)
            .where(sessions.c.session_id == session_id)
            .with_for_update()
        )
    ).first()
    if locked is None or locked.active_run_id != run_id:
        return None
    next_run = (
        await conn.execute(
            select(runs.c.run_id)
            .where(
                runs.c.session_id == session_id, runs.c.status == "queued", runs.c.run_id != run_id
            )
            .order_by(runs.c.created_at, runs.c.run_id)
            .limit(1)
        )
    ).scalar()
    await conn.execute(
        update(sessions).where(sessions.c.session_id == session_id).values(active_run_id=next_run)
    )
    if next_run is not None:
        await conn.execute(update(runs).where(runs.c.run_id == next_run).values(session_head=True))
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
