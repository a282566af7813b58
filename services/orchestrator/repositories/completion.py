"""A run's completion in one round trip: a statement that takes the run under the lease fence and
calls `tether_complete_run`, a PL/pgSQL function built from the aggregate's own statements (the
parts and priced turns a checkpoint writes, the guarded move with its events, the session's
hand-over, the attempt's close with its audit) and frozen in migration 0011.

Why a function: the usage total must see every turn committed before the run was locked, and
the hand-over's search every message admitted before the session was locked (see
`transitions.hand_over_session`); only a statement begun after the lock sees them. Inside a
VOLATILE function each statement takes its own snapshot, with no round trip between them.

The function is generated here (`function_ddl`) from the same statements the rest of the
aggregate runs, so the lease fence, the event append and the hand-over are written once; a test
fails when the migration's copy no longer matches what this module generates (a change to one
of those statements then needs a migration replacing the function).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Text,
    bindparam,
    column,
    func,
    select,
    true,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.dialects.postgresql.base import PGCompiler, PGDialect
from sqlalchemy.engine import Row
from sqlalchemy.sql.elements import BindParameter

from services.orchestrator.repositories import leases, progress
from services.orchestrator.repositories.answers import answer_of
from services.orchestrator.repositories.transitions import (
    HAND_OVER,
    LEASE_EPOCH,
    LEASE_HELD,
    LOCK_SESSION,
    NOW,
    Moved,
    move_statement,
    numbered,
    stored_event_params,
)
from tether import formats, states
from tether.db.direct import Direct
from tether.db.schema import runs
from tether.domain import (
    Batch,
    Cancelled,
    Completed,
    Ending,
    Event,
    EventType,
    Failed,
    ModelTurn,
    Part,
    Run,
    RunError,
    StoredEvent,
    camel,
    cancelled_error,
    run_completed,
)
from tether.pricing import TOKEN_FIELDS

FUNCTION = "tether_complete_run"
# The key run.completed has whole and not stored by reference.
_ANSWER, _ = formats.BY_REFERENCE_WITHOUT[EventType.RUN_COMPLETED]
_COMPLETE = states.COMPLETE
_USAGE_FIELDS = (*TOKEN_FIELDS, "cost_micros")


# -- what an ending writes on the run ------------------------------------------------------------


def ending_error(ending: Ending) -> RunError | None:
    """The run's (and the attempt's) error for an ending."""
    if isinstance(ending, Failed):
        return ending.error
    if isinstance(ending, Cancelled):
        return cancelled_error(ending.reason)
    return None


def ending_warnings(ending: Ending) -> tuple[str, ...]:
    """The warnings an ending reports."""
    return ending.warnings if isinstance(ending, Completed) else ()


def ending_values(ending: Ending) -> dict[str, Any]:
    """The run's columns an ending sets."""
    error = ending_error(ending)
    completed = ending if isinstance(ending, Completed) else None
    return {
        "result_text": completed.result_text or None if completed else None,
        "task_outcome": completed.task_outcome or None if completed else None,
        "warnings": list(ending_warnings(ending)),
        "error": None if error is None else error.to_row(),
    }


# -- the function's inputs and outputs -----------------------------------------------------------

# The columns a completion sets from what the worker reported (a completion has no error).
_REPORTED = [k for k in ending_values(Completed()) if k != "error"]
# Its inputs after the lease fence's own (the run, its epoch, whether a cancel came first and
# whether the in-flight batch lands): the in-flight batch, the completion's parts, turns and
# events, what the run reports, and the attempt's stage durations and audit detail.
_INPUTS: list[tuple[str, Any]] = [
    *[(f"flight_{k}", t) for k, t in progress.BATCH_ARRAYS],
    ("flight_e_types", ARRAY(Text)),
    ("flight_e_payloads", ARRAY(Text)),
    *progress.BATCH_ARRAYS,
    ("e_types", ARRAY(Text)),
    ("e_payloads", ARRAY(Text)),
    *[(k, runs.c[k].type) for k in _REPORTED],
    ("stages", JSONB()),
    ("audit_detail", JSONB()),
    # Whether the answer may be stored as its parts alone (stored format 5).
    ("answer_by_reference", Boolean()),
    # Whether its events go in one row (stored format 6): the release before calls the
    # function without it, which PostgreSQL keeps beside this one (0045).
    ("e_together", Boolean()),
]
# Its outputs: what it did, whether the in-flight batch landed, the session's next head, and
# the run as completed (NULL unless it did).
_OUTPUTS: list[tuple[str, Any]] = [
    ("outcome", Text()),
    ("flight_landed", Boolean()),
    ("handed_over", Text()),
    *[(c.name, c.type) for c in runs.c],
]
COMPLETED, CANCEL_REQUESTED = "completed", "cancel_requested"

# The statement: the run locked under the lease fence (a stale lease matches nothing, and the
# function is not called), then the function with what the lock saw.
_FENCE = (
    select(runs.c.cancel_requested_at, runs.c.checkpoint_batch, runs.c.run_id)
    .where(runs.c.run_id == bindparam("r_run_id"), LEASE_HELD)
    .with_for_update(key_share=True)
    .cte("fence")
)
_DONE = getattr(func, FUNCTION)(
    _FENCE.c.cancel_requested_at.is_(None),
    _FENCE.c.checkpoint_batch < bindparam("flight_batch", type_=BigInteger),
    _FENCE.c.run_id,
    LEASE_EPOCH,
    *[bindparam(name, type_=type_) for name, type_ in _INPUTS],
).table_valued(*[column(name, type_) for name, type_ in _OUTPUTS], name="done")
# The completion (bench.topology_floor sends it bare, to measure what its records cost apart
# from the service around it). A stale lease gets no row; a row names the run it fenced as
# `fenced` (a cancel's row has no run): a group commit sends several completions at once and
# reads each one's own row by it (`Committer.write_statement`).
FENCED = "fenced"
COMPLETE = Direct(
    select(*_DONE.c, _FENCE.c.run_id.label(FENCED)).select_from(_FENCE.join(_DONE, true()))
)


@dataclass(frozen=True)
class Ended:
    """A completion that reached its run: the run as completed with the events appended for it
    (the in-flight batch's, when it landed, in `landed`), or, when a cancel was accepted
    first, nothing written at all (`moved` None: the run must end cancelled instead)."""

    moved: Moved | None
    landed: list[StoredEvent]


def ended(
    row: Row[Any] | None, ending: Completed, events: Sequence[Event], flight: Batch
) -> Ended | None:
    """What `COMPLETE`'s row says of a completion (`complete_params`): None for no row (a stale
    lease: nothing was written), an `Ended` with no move when a cancel came first."""
    if row is None:
        return None
    if row.outcome == CANCEL_REQUESTED:
        return Ended(None, [])
    completed = [*events, run_completed(ending, row.usage)]
    landed = list(flight.events) if row.flight_landed else []
    stored = numbered(row.last_seq, [*landed, *completed])
    # The answer as the worker gave it, which the row holds or its parts do (format 5).
    run = replace(Run.from_row(row._mapping), result_text=ending.result_text or None)
    moved = Moved(run, stored[len(landed) :], row.handed_over)
    return Ended(moved, stored[: len(landed)])


def complete_params(
    run_id: str,
    epoch: int,
    ending: Completed,
    *,
    in_flight: Batch,
    parts: Sequence[Part],
    events: Sequence[Event],
    turns: Sequence[ModelTurn],
    stages: Mapping[str, Any],
    audit: Mapping[str, Any],
    stored_format: int = formats.NEWEST,
) -> dict[str, Any]:
    """The values `COMPLETE` binds to complete the run `run_id` under lease `epoch` in ONE
    statement: the in-flight batch (`in_flight`, its turns priced) unless it landed already,
    `parts` and priced `turns`, the move to completed with `events` and run.completed (its usage
    totalled in the statement), the session handed to its next message, the attempt closed with
    `stages` and its audit record (`audit`, and the usage). Its events are stored by reference
    where they may be, up to `stored_format` (`tether.formats`; CURRENT stores them whole, as a
    release before reads them). `ended` reads what its row says."""
    # Whole, its usage is totalled, and filled in, by the function.
    terminal = run_completed(ending, {})
    # The parts its events may refer to when stored by reference: those the statement writes,
    # the in-flight batch's (or landed already, with its events) and the completion's; each
    # batch's usage.updated, to its own turns.
    written = [*in_flight.parts, *parts]
    reported = ending_values(ending)
    return {
        "r_run_id": run_id,
        "held_epoch": epoch,
        "flight_batch": in_flight.number,
        **{
            f"flight_{k}": v
            for k, v in progress.batch_params(in_flight.parts, in_flight.turns).items()
        },
        **{
            f"flight_{k}": v
            for k, v in stored_event_params(
                in_flight.events, written, in_flight.turns, stored_format
            ).items()
            if k != "e_together"  # the function appends them with the completion's, together
        },
        **progress.batch_params(parts, turns),
        **stored_event_params([*events, terminal], written, turns, stored_format),
        **{k: reported[k] for k in _REPORTED},
        "stages": dict(stages),
        "audit_detail": dict(audit),
        "answer_by_reference": stored_format >= formats.ANSWER_BY_REFERENCE,
    }


# -- the function, generated from the aggregate's statements -------------------------------------

_DIALECT = PGDialect()  # type: ignore[no-untyped-call]  # SQLAlchemy dialects are unannotated


def _sql(statement: Any, names: Mapping[str, str], *, depth: int = 1) -> str:
    """`statement` as the function runs it (indented `depth` levels): each named parameter
    becomes the expression `names` gives it (a variable of the function), every other value is
    written inline. A parameter `names` does not know is an error, never a guess."""

    class Compiler(PGCompiler):
        def visit_bindparam(self, bindparam: BindParameter[Any], *args: Any, **kw: Any) -> Any:
            if bindparam.unique:  # an inline value (a literal, a comparison's constant)
                visit: Any = super().visit_bindparam
                return visit(bindparam, *args, **kw)
            return names[bindparam.key]

    compiler: Any = Compiler
    compiled = compiler(_DIALECT, statement, compile_kwargs={"literal_binds": True})
    return _indent(str(compiled).strip(), 4 * depth)


def _indent(text: str, spaces: int) -> str:
    pad = " " * spaces
    return "\n".join(pad + line.rstrip() if line.strip() else "" for line in text.splitlines())


def _literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _type(type_: Any) -> str:
    return str(type_.compile(dialect=_DIALECT))


def _batch(prefix: str) -> dict[str, str]:
    """A checkpoint's parts and turns, as the function's `prefix`ed arrays (its turns' events
    take the seqs after `_seq_before`)."""
    return {
        "r_run_id": "_run_id",
        "held_epoch": "_held_epoch",
        "e_types": f"_{prefix}e_types",
        "seq_before": "_seq_before",
        **{k: f"_{prefix}{k}" for k, _ in progress.BATCH_ARRAYS},
    }


def function_ddl() -> str:
    """CREATE OR REPLACE FUNCTION tether_complete_run: the completion after its lease fence."""
    inputs = [
        ("proceed", Boolean()),
        ("flight_lands", Boolean()),
        ("run_id", Text()),
        ("held_epoch", BigInteger()),
        *_INPUTS,
    ]
    arguments = ",\n    ".join(f"_{name} {_type(type_)}" for name, type_ in inputs)
    outputs = ",\n    ".join(f"{name} {_type(type_)}" for name, type_ in _OUTPUTS)
    totals = {k: f"_total.{k}" for k in _USAGE_FIELDS}
    # The run's total as it is stored (`runs.usage`, the attempt's record): its fields that are
    # not 0, as `progress.usage_total` gives it (a reader takes a field left out as 0).
    usage = ", ".join(f"{_literal(k)}, NULLIF({v}, 0)" for k, v in totals.items())
    # run.completed's usage: what `tether.domain.run_completed` writes (camelCase, zeros left
    # out); a test holds the two equal.
    usage_event = ", ".join(f"{_literal(camel(k))}, NULLIF({v}, 0)" for k, v in totals.items())
    reported = {f"v_{k}": f"_{k}" for k in _REPORTED}
    move_values: dict[str, Any] = {
        **leases.lease_cleared(),
        **dict.fromkeys(_REPORTED, "bound"),
        "error": None,
        "finished_at": NOW,
        "usage": "bound",
        "format": "bound",
    }
    move = _sql(
        move_statement(_COMPLETE, move_values),
        {
            "t_run_id": "_run_id",
            "held_epoch": "_held_epoch",
            "e_types": "_e_types",
            "e_payloads": "_e_payloads",
            "e_together": "_e_together",
            "v_usage": "_usage",
            "v_format": "_run_format",
            **reported,
        },
    )
    answer = _sql(select(answer_of(bindparam("a_run_id"))), {"a_run_id": "_run_id"}, depth=2)
    session = {"h_session_id": "_moved.session_id", "h_run_id": "_run_id"}
    end_attempt = _sql(
        leases.end_attempt_statement(),
        {
            "a_run_id": "_run_id",
            "a_epoch": "_held_epoch",
            "a_outcome": _literal(_COMPLETE.target.value),
            "a_error": "NULL",
            "a_stages": "_stages",
            "a_detail": "(_audit_detail || jsonb_build_object('usage', _usage))",
        },
    )
    run_columns = "\n".join(f"    {c.name} := _moved.{c.name};" for c in runs.c)
    return f"""CREATE OR REPLACE FUNCTION {FUNCTION}(
    {arguments}
) RETURNS TABLE (
    {outputs}
) LANGUAGE plpgsql VOLATILE AS $function$
#variable_conflict use_column
DECLARE
    _total record;
    _usage jsonb;
    _moved record;
    _session record;
    _next text;
    _seq_before bigint;
    _run_format smallint;
    _answer text;
BEGIN
    IF NOT _proceed THEN
        -- A cancel was accepted first: nothing is written; the caller ends the run cancelled.
        outcome := {_literal(CANCEL_REQUESTED)};
        RETURN NEXT;
        RETURN;
    END IF;
    -- The events take the seqs after the run's last: the in-flight batch's, then the
    -- completion's. Each turn names its usage.updated's.
    SELECT runs.last_seq, runs.format INTO _seq_before, _run_format
    FROM runs WHERE runs.run_id = _run_id;
    IF _flight_lands THEN
        -- The checkpoint the worker had no answer for, unless it landed already.
{_sql(progress.PARTS, _batch("flight_"), depth=2)};
{_sql(progress.TURNS, _batch("flight_"), depth=2)};
        _seq_before := _seq_before + coalesce(cardinality(_flight_e_types), 0);
    END IF;
{_sql(progress.PARTS, _batch(""))};
{_sql(progress.TURNS, _batch(""))};
    IF _flight_lands THEN
        _e_types := _flight_e_types || _e_types;
        _e_payloads := _flight_e_payloads || _e_payloads;
    END IF;
    IF _answer_by_reference AND _result_text IS NOT NULL THEN
        -- The answer stored once, as its parts (format {formats.ANSWER_BY_REFERENCE}), when
        -- they hold exactly the worker's (repositories/answers.py); else whole, as before.
{answer}
        INTO _answer;
        IF _answer IS NOT DISTINCT FROM _result_text THEN
            _result_text := NULL;
            _run_format := greatest(_run_format, {formats.ANSWER_BY_REFERENCE});
        END IF;
    END IF;
{_sql(progress.USAGE_TOTAL, {"run_id": "_run_id"})}
    INTO _total;
    _usage := jsonb_strip_nulls(jsonb_build_object({usage}));
    IF _e_payloads[cardinality(_e_payloads)]::jsonb ? {_literal(_ANSWER)} THEN
        -- Stored whole (format {formats.CURRENT}): the total goes on it. Stored by reference
        -- (format {formats.BY_REFERENCE}), it carries neither the answer nor the total: the
        -- run's own.
        _e_payloads[cardinality(_e_payloads)] := (
            _e_payloads[cardinality(_e_payloads)]::jsonb
            || jsonb_build_object('usage', jsonb_strip_nulls(jsonb_build_object({usage_event})))
        )::text;
    END IF;
{move}
    INTO _moved;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'run % moved while its completion held it', _run_id;
    END IF;
    -- The session's lock, then the search for its next message in a statement of its own.
{_sql(LOCK_SESSION, session)}
    INTO _session;
    IF FOUND THEN
{_sql(HAND_OVER, session, depth=2)}
        INTO _next;
    END IF;
{end_attempt};
    outcome := {_literal(COMPLETED)};
    flight_landed := _flight_lands;
    handed_over := _next;
{run_columns}
    RETURN NEXT;
END;
$function$"""
