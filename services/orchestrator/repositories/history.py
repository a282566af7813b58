"""A leased run's inputs, read in the claim's one statement (`attempt_inputs`): its session's
history (the earlier runs it reads, and the summary standing in for older ones), its own parts
and the last model turn; and a compaction's summary, named its session's (`record_summary`).
The parts themselves, their rows and formats, are `parts`'."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    ColumnElement,
    DateTime,
    Exists,
    FromClause,
    Integer,
    Text,
    bindparam,
    column,
    func,
    literal_column,
    null,
    select,
    true,
    union_all,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from services.orchestrator.repositories.parts import read
from tether.db.direct import Direct
from tether.db.schema import (
    context_summaries,
    keyed_runs,
    run_keys,
    run_parts,
    runs,
    usage_turns,
)
from tether.domain import Part, Summary
from tether.errors import FailedPrecondition, InvalidArgument
from tether.states import RunStatus


def has_earlier_completed(session_id: ColumnElement[Any], created_at: ColumnElement[Any]) -> Exists:
    """Whether the session `session_id` has a completed run created before `created_at` (the
    claim asks it of each run it leases): its earlier runs found by their keys (`run_keys`: runs
    has no index by session), each then by its id."""
    earlier, keys = runs.alias("earlier"), run_keys.alias("earlier_keys")
    return (
        select(earlier.c.run_id)
        .select_from(keyed_runs(earlier, keys))
        .where(
            keys.c.session_id == session_id,
            keys.c.created_at < created_at,
            earlier.c.status == RunStatus.COMPLETED.value,
        )
        .exists()
    )


_SUMMARISING = runs.alias("summarising")
_THROUGH = runs.alias("through")
_RECORD_SUMMARY = (
    pg_insert(context_summaries)
    .from_select(
        ["session_id", "through_run_id", "through_created_at", "run_id", "part_index"],
        select(
            _SUMMARISING.c.session_id,
            _THROUGH.c.run_id,
            _THROUGH.c.created_at,
            _SUMMARISING.c.run_id,
            bindparam("cs_part_index", type_=Integer),
        ).where(
            _SUMMARISING.c.run_id == bindparam("cs_run_id"),
            _THROUGH.c.run_id == bindparam("cs_through"),
            _THROUGH.c.session_id == _SUMMARISING.c.session_id,
            _THROUGH.c.created_at < _SUMMARISING.c.created_at,
        ),
    )
    .on_conflict_do_nothing()
    .returning(context_summaries.c.through_run_id)
)
_SUMMARY_EXISTS = select(context_summaries.c.run_id).where(
    context_summaries.c.session_id
    == select(runs.c.session_id).where(runs.c.run_id == bindparam("cs_run_id")).scalar_subquery(),
    context_summaries.c.through_run_id == bindparam("cs_through"),
)


async def record_summary(conn: AsyncConnection, run_id: str, part: Part) -> None:
    """Name `part` (a summary the run just stored) as its session's summary through the run
    it covers to: one per range. FailedPrecondition when that range has a summary already,
    InvalidArgument when it does not end at an earlier run of the session; the caller's
    transaction then stores nothing."""
    summary = part.content
    if not isinstance(summary, Summary):
        raise InvalidArgument("only a summary part names a session's summary")
    params = {
        "cs_run_id": run_id,
        "cs_through": summary.through_run_id,
        "cs_part_index": part.index,
    }
    if (await conn.execute(_RECORD_SUMMARY, params)).first() is not None:
        return
    if (await conn.execute(_SUMMARY_EXISTS, params)).first() is not None:
        raise FailedPrecondition(
            f"the session already has a summary through run {summary.through_run_id}",
            code="summary_exists",
        )
    raise InvalidArgument(
        f"a summary must end at an earlier run of the session; {summary.through_run_id!r} is not"
    )


@dataclass(frozen=True)
class LastTurn:
    """What the session's last model turn reported (input plus output tokens; 0 when unknown),
    and whether it was the leased run's own (else an earlier run's)."""

    tokens: int
    own: bool


NO_TURN = LastTurn(0, False)


# How many of its session's earlier completed runs a run reads as its history.
HISTORY_RUNS = 50


@dataclass(frozen=True)
class EarlierRun:
    """A completed run of the same session, as the history of a later one sees it."""

    run_id: str
    input_text: str
    parts: list[Part]
    created_at: datetime


# Per leased run that needs them: its session's latest summary (the context compaction that
# stands in for the runs up to the one it ends at), the last completed runs after that summary
# and before the run, each with its transcript (superseded parts left out), the run's own parts
# (superseded ones flagged), and the last model turn of the run or of the session's previous
# run, when it is newer than the summary (its tokens start the context budget's estimate).
#
# The wanted runs are one JSON parameter, and the history's length a column of each, so that the
# statement plans alike for any values: PostgreSQL estimates jsonb_to_recordset at 100 rows
# whatever its argument, where it sizes an array's unnest from the values bound (a custom plan)
# but guesses 10 without them (a generic one), and so never chose the generic plan. Planning
# this statement costs more than running it (0.8 ms against 0.2 at turn 500 of a conversation);
# with estimates that do not depend on the values, a connection plans it for its first five
# executions and then keeps one generic plan (tests/integration/test_claim_batch.py, "planned
# once"). Its constants are written inline for the same reason: a bound 'completed' or LIMIT 1
# is estimated one way with its value and another without.
_ONE = literal_column("1", Integer)
_COMPLETED = literal_column(f"'{RunStatus.COMPLETED.value}'", Text)
_WANTED = (
    func.jsonb_to_recordset(bindparam("wanted", type_=JSONB))
    .table_valued(
        column("run_id", Text),
        column("session_id", Text),
        column("before", DateTime(timezone=True)),
        column("history", Boolean),
        column("own", Boolean),
        column("known_after", DateTime(timezone=True)),
        column("known_summary_run", Text),
        column("known_summary_index", Integer),
        column("limit_runs", Integer),
    )
    .render_derived("wanted", with_types=True)
)
_LATEST_SUMMARY = (
    select(
        context_summaries.c.through_created_at,
        context_summaries.c.created_at.label("summarised_at"),
        context_summaries.c.run_id.label("summary_run_id"),
        context_summaries.c.part_index.label("summary_part_index"),
    )
    .where(
        _WANTED.c.history,
        context_summaries.c.session_id == _WANTED.c.session_id,
        context_summaries.c.through_created_at < _WANTED.c.before,
    )
    .order_by(context_summaries.c.through_created_at.desc())
    .limit(_ONE)
    .lateral("summary")
)
_NEVER: Any = literal_column("'-infinity'::timestamptz")
# The session's runs by their keys (`run_keys`, newest first), each then by its id.
_RECENT_RUNS = (
    select(runs.c.run_id, runs.c.input_text, run_keys.c.created_at)
    .select_from(keyed_runs())
    .where(
        _WANTED.c.history,
        run_keys.c.session_id == _WANTED.c.session_id,
        runs.c.status == _COMPLETED,
        run_keys.c.created_at < _WANTED.c.before,
        run_keys.c.created_at > func.coalesce(_LATEST_SUMMARY.c.through_created_at, _NEVER),
        # What the worker holds already (its newest run's created_at) is not read again: the
        # runs of a session complete in the order they were created (one head at a time).
        run_keys.c.created_at > func.coalesce(_WANTED.c.known_after, _NEVER),
    )
    .order_by(run_keys.c.created_at.desc())
    .limit(_WANTED.c.limit_runs)
    .lateral("earlier")
)
_WITH_SUMMARY = _WANTED.outerjoin(_LATEST_SUMMARY, true())
_PART_COLUMNS = [c for c in run_parts.c if c.name != "run_id"]


def _kind(name: str) -> Any:
    return literal_column(f"'{name}'", Text).label("row_kind")


def read_as_history(run: FromClause) -> ColumnElement[bool]:
    """Whether `run` (a FROM of `runs`) is among what its session's next run reads as history
    (`attempt_inputs`: the last `limit_runs` completed runs, bound as such, and the run holding
    the session's latest summary); retention keeps these while the conversation is live.
    Bounded: it reads at most `limit_runs` newer runs, and the summaries of one run."""
    newer = runs.alias("newer")
    newer_keys = run_keys.alias("newer_keys")
    last_of_history = (
        select(newer.c.run_id)
        .select_from(keyed_runs(newer, newer_keys))
        .where(
            newer_keys.c.session_id == run.c.session_id,
            newer.c.status == RunStatus.COMPLETED.value,
            newer_keys.c.created_at > run.c.created_at,
        )
        .order_by(newer_keys.c.created_at)
        .offset(bindparam("limit_runs") - 1)
        .limit(1)
    )
    fewer = ~last_of_history.exists()
    # The run that holds its session's latest summary: the next run reads the summary in place
    # of the runs it covers.
    latest = context_summaries.alias("latest")
    later = context_summaries.alias("later")
    holds_summary = (
        select(latest.c.run_id)
        .where(
            latest.c.run_id == run.c.run_id,
            ~select(later.c.run_id)
            .where(
                later.c.session_id == latest.c.session_id,
                later.c.through_created_at > latest.c.through_created_at,
            )
            .exists(),
        )
        .exists()
    )
    return ((run.c.status == RunStatus.COMPLETED.value) & fewer) | holds_summary


_HISTORY = select(
    _WANTED.c.run_id.label("for_run"),
    _kind("history"),
    _RECENT_RUNS.c.run_id.label("earlier_run_id"),
    _RECENT_RUNS.c.input_text,
    _RECENT_RUNS.c.created_at.label("earlier_created_at"),
    null().cast(BigInteger).label("turn_tokens"),
    *_PART_COLUMNS,
).select_from(
    _WITH_SUMMARY.join(_RECENT_RUNS, true()).outerjoin(
        run_parts,
        (run_parts.c.run_id == _RECENT_RUNS.c.run_id) & run_parts.c.superseded_at.is_(None),
    )
)
# The summary's part, unless it is the one the worker holds: found by its key alone (a lateral
# probe, never a hash of every run's parts however few a fresh database has).
_SUMMARY_ROW = (
    select(*_PART_COLUMNS)
    .where(
        run_parts.c.run_id == _LATEST_SUMMARY.c.summary_run_id,
        run_parts.c.part_index == _LATEST_SUMMARY.c.summary_part_index,
        ~(
            (_LATEST_SUMMARY.c.summary_run_id == _WANTED.c.known_summary_run)
            & (_LATEST_SUMMARY.c.summary_part_index == _WANTED.c.known_summary_index)
        ),
    )
    .limit(_ONE)  # one part by its key; and the planner keeps it a probe, not a join
    .lateral("summary_part")
)
# The latest summary: which part it is and the run it ends at (`earlier_created_at`: that run's
# created_at), with the part unless it is the one the worker holds (then its columns are NULL).
_SUMMARY_PART = (
    select(
        _WANTED.c.run_id.label("for_run"),
        _kind("summary"),
        _LATEST_SUMMARY.c.summary_run_id.label("earlier_run_id"),
        null().cast(Text).label("input_text"),
        _LATEST_SUMMARY.c.through_created_at.label("earlier_created_at"),
        _LATEST_SUMMARY.c.summary_part_index.cast(BigInteger).label("turn_tokens"),
        *[_SUMMARY_ROW.c[c.name] for c in _PART_COLUMNS],
    )
    .select_from(_WITH_SUMMARY.outerjoin(_SUMMARY_ROW, true()))
    .where(_LATEST_SUMMARY.c.summary_run_id.is_not(None))
)
_PREVIOUS = runs.alias("previous")
_PREVIOUS_KEYS = run_keys.alias("previous_keys")
_PREVIOUS_RUN = (
    select(_PREVIOUS.c.run_id.label("previous_run_id"))
    .select_from(keyed_runs(_PREVIOUS, _PREVIOUS_KEYS))
    .where(
        _WANTED.c.history,
        _PREVIOUS_KEYS.c.session_id == _WANTED.c.session_id,
        _PREVIOUS.c.status == _COMPLETED,
        _PREVIOUS_KEYS.c.created_at < _WANTED.c.before,
    )
    .order_by(_PREVIOUS_KEYS.c.created_at.desc())
    .limit(_ONE)
    .lateral("previous_run")
)
_LAST_TURN = (
    select(
        usage_turns.c.run_id,
        usage_turns.c.created_at,
        (
            usage_turns.c.input_tokens
            + usage_turns.c.cache_creation_input_tokens
            + usage_turns.c.cache_read_input_tokens
            + usage_turns.c.output_tokens
        ).label("tokens"),
    )
    .where(
        # A list, not an OR: one probe of ix_usage_turns_run for both runs, with no bitmap scan
        # (the claims' pool, which reads the history, plans without them: CLAIM_PLANNER).
        usage_turns.c.run_id.in_([_WANTED.c.run_id, _PREVIOUS_RUN.c.previous_run_id]),
        usage_turns.c.created_at > func.coalesce(_LATEST_SUMMARY.c.summarised_at, _NEVER),
    )
    .order_by(usage_turns.c.id.desc())
    .limit(_ONE)
    .lateral("last_turn")
)
_TURN = select(
    _WANTED.c.run_id.label("for_run"),
    _kind("turn"),
    _LAST_TURN.c.run_id.label("earlier_run_id"),
    null().cast(Text).label("input_text"),
    _LAST_TURN.c.created_at.label("earlier_created_at"),
    _LAST_TURN.c.tokens.label("turn_tokens"),
    *[null().cast(c.type).label(c.name) for c in _PART_COLUMNS],
).select_from(_WITH_SUMMARY.outerjoin(_PREVIOUS_RUN, true()).join(_LAST_TURN, true()))
_OWN = select(
    _WANTED.c.run_id.label("for_run"),
    _kind("own"),
    null().cast(Text).label("earlier_run_id"),
    null().cast(Text).label("input_text"),
    null().cast(DateTime(timezone=True)).label("earlier_created_at"),
    null().cast(BigInteger).label("turn_tokens"),
    *_PART_COLUMNS,
).select_from(_WANTED.join(run_parts, (run_parts.c.run_id == _WANTED.c.run_id) & _WANTED.c.own))
_INPUTS = Direct(
    union_all(_HISTORY, _SUMMARY_PART, _TURN, _OWN).order_by(
        "for_run", "earlier_created_at", "earlier_run_id", "part_index"
    )
)


@dataclass(frozen=True)
class Wanted:
    """A leased run's inputs to read: its session's history (`session_id`, before `created_at`)
    when there is any, and its own parts when it may have some."""

    run_id: str
    session_id: str
    created_at: datetime
    history: bool
    own: bool
    # What the worker to be leased the run holds of its session already: the created_at of its
    # newest earlier run (None: no run), and its summary (run id, part index).
    known_after: datetime | None = None
    known_summary: tuple[str, int] | None = None


@dataclass(frozen=True)
class SummaryMark:
    """Which part a session's latest summary is (`run_id`, `part_index`), and the created_at of
    the run it ends at (the history's earlier runs are those after it)."""

    run_id: str
    part_index: int
    through_created_at: datetime

    @property
    def key(self) -> str:
        """Its name on the wire (LeaseHistory.summary_key)."""
        return f"{self.run_id}/{self.part_index}"


@dataclass
class AttemptInputs:
    """What a leased run's attempt starts from: the session's earlier runs (oldest first, after
    the latest summary), the summary part standing in for the runs before them, the run's own
    parts, and the session's last model turn (see `LastTurn`)."""

    earlier: list[EarlierRun] = field(default_factory=list)
    own: list[Part] = field(default_factory=list)
    summary: Part | None = None
    last_turn: LastTurn = NO_TURN
    # The latest summary's place, read even when its part is not (the worker holds it).
    summary_mark: SummaryMark | None = None


async def attempt_inputs(
    conn: AsyncConnection, wanted: Sequence[Wanted], *, limit_runs: int
) -> dict[str, AttemptInputs]:
    """For each run of `wanted`, by id, its `AttemptInputs`: at most the last `limit_runs`
    completed runs of its session after the latest summary, each with its transcript; one query
    for them all, none when nothing is wanted."""
    asked = [w for w in wanted if w.history or w.own]
    found: dict[str, AttemptInputs] = {w.run_id: AttemptInputs() for w in wanted}
    if not asked:
        return found
    rows = [
        {
            "run_id": w.run_id,
            "session_id": w.session_id,
            "before": w.created_at.isoformat(),
            "history": w.history,
            "own": w.own,
            "known_after": None if w.known_after is None else w.known_after.isoformat(),
            # Never NULL: the summary's join compares them, and a NULL would hide the part.
            "known_summary_run": w.known_summary[0] if w.known_summary else "",
            "known_summary_index": w.known_summary[1] if w.known_summary else -1,
            "limit_runs": limit_runs,
        }
        for w in asked
    ]
    for row in await _INPUTS.all(conn, {"wanted": rows}):
        inputs = found[row.for_run]
        if row.row_kind == "own":
            inputs.own.append(read(row, row.for_run))
        elif row.row_kind == "summary":
            inputs.summary_mark = SummaryMark(
                row.earlier_run_id, int(row.turn_tokens), row.earlier_created_at
            )
            if row.part_index is not None:  # else the worker holds it
                inputs.summary = read(row, row.earlier_run_id)
        elif row.row_kind == "turn":
            inputs.last_turn = LastTurn(int(row.turn_tokens), row.earlier_run_id == row.for_run)
        else:
            earlier = inputs.earlier
            if not earlier or earlier[-1].run_id != row.earlier_run_id:
                earlier.append(
                    EarlierRun(row.earlier_run_id, row.input_text, [], row.earlier_created_at)
                )
            if row.part_index is not None:
                earlier[-1].parts.append(read(row, row.earlier_run_id))
    return found
