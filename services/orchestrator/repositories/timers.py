"""The timers' waker as one statement: every due timer (up to a batch), locked with SKIP LOCKED,
moved waiting-for-timer -> queued with its `timer.fired` and `run.queued` appended, however many
runs are due at once (1,000 timers due in one second are a few statements, not 1,000)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Text, bindparam, case, func, literal, null, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from services.orchestrator.repositories.transitions import (
    appended_events,
    numbered,
    sql_value,
)
from tether import states
from tether.db.direct import Direct
from tether.db.schema import in_state, runs
from tether.domain import Run, StoredEvent, run_queued, timer_fired
from tether.states import RunStatus

_DUE = (
    select(runs.c.run_id, runs.c.next_wake_at.label("due_at"))
    .where(
        in_state(runs.c.status, RunStatus.WAITING_FOR_TIMER),
        runs.c.next_wake_at <= func.now(),
    )
    .order_by(runs.c.next_wake_at)
    .limit(bindparam("fire_limit"))
    .with_for_update(skip_locked=True)
    .cte("due_timers")
)


def _rfc3339(when: Any) -> Any:
    """`when` (timestamptz) as `timers.rfc3339` writes it: UTC, `Z`, microseconds only when
    it has them."""
    utc = func.timezone("UTC", when)
    whole = func.to_char(utc, literal('YYYY-MM-DD"T"HH24:MI:SS"Z"', Text))
    precise = func.to_char(utc, literal('YYYY-MM-DD"T"HH24:MI:SS.US"Z"', Text))
    return case((func.date_trunc("second", when) == when, whole), else_=precise)


def _fired_events(moved: Any) -> list[Any]:
    return [timer_fired(sql_value(_rfc3339(moved.c.due_at))), run_queued(0, "timer")]


# How many events each fired run gets (its last_seq moves on by as many).
_EVENT_COUNT = 2
_FIRED = (
    update(runs)
    .where(
        runs.c.run_id == _DUE.c.run_id,
        runs.c.status.in_([s.value for s in states.TIMER_FIRED.sources]),
    )
    .values(
        status=states.TIMER_FIRED.target.value,
        next_wake_at=null(),
        updated_at=func.now(),
        last_seq=runs.c.last_seq + literal(_EVENT_COUNT),
    )
    .returning(*runs.c, _DUE.c.due_at)
    .cte("fired_timers")
)
FIRE = Direct(select(_FIRED).add_cte(appended_events(_FIRED, _fired_events(_FIRED))))


@dataclass(frozen=True, slots=True)
class Fired:
    """A run its timer woke: as it now stands, and its events with their seqs."""

    run: Run
    events: list[StoredEvent]


async def fire_due(conn: AsyncConnection, limit: int, rfc3339: Any) -> list[Fired]:
    """Queue up to `limit` due timers' runs, each once (`rfc3339` writes their due time as the
    published events carry it)."""
    rows = await FIRE.all(conn, {"fire_limit": limit})
    fired = []
    for row in rows:
        due: datetime = row.due_at
        events = [timer_fired(rfc3339(due)), run_queued(0, "timer")]
        fired.append(Fired(Run.from_row(row._mapping), numbered(row.last_seq, events)))
    return fired
