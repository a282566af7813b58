"""A completed run's answer, stored once: as its parts (stored format 5, `tether.formats`).

The answer is the text of the run's assistant text parts after its last part that is not the
assistant's (a tool's result, a person's answer), in order; from its first part when every
part is the assistant's. That is the worker's answer of a run that ended on a model turn of its
own (`Transcript.final_text` from the turn's start). The completion stores `runs.result_text`
NULL and `runs.format` 5 only when `answer_of` gives the worker's answer exactly, checked in
the same statement (`services.orchestrator.repositories.completion`); every other answer is
stored whole, as before. Readers take `shown_result_text` in place of `runs.result_text`.

Superseded parts (an attempt cut off mid-turn) are in no transcript, and in no answer.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, and_, case, func, literal_column, select
from sqlalchemy.dialects.postgresql import aggregate_order_by

from tether import formats
from tether.db.schema import run_parts, runs
from tether.domain import PartKind, Role
from tether.states import RunStatus


def answer_of(run_id: Any) -> Any:
    """The answer the parts of the run `run_id` (a column or a variable) hold, as a scalar
    subquery: its assistant text parts with no later part that is not the assistant's, in
    order; NULL when it has no such part."""
    text = run_parts.alias("answer_text")
    other = run_parts.alias("answer_other")
    later_other = (
        select(literal_column("1"))
        .where(
            other.c.run_id == text.c.run_id,
            other.c.part_index > text.c.part_index,
            other.c.superseded_at.is_(None),
            other.c.role != Role.ASSISTANT.value,
        )
        .exists()
    )
    return (
        select(
            func.string_agg(
                text.c.payload["text"].astext,
                aggregate_order_by(literal_column("''"), text.c.part_index),
            )
        )
        .where(
            text.c.run_id == run_id,
            text.c.superseded_at.is_(None),
            text.c.role == Role.ASSISTANT.value,
            text.c.kind == PartKind.TEXT.value,
            ~later_other,
        )
        .scalar_subquery()
    )


def shown_result_text(table: Any) -> ColumnElement[Any]:
    """`table`'s (runs, or an alias of it) result_text as readers show it, labelled so: the
    answer its parts hold for a completed run stored by reference, the column otherwise."""
    by_reference = and_(
        table.c.result_text.is_(None),
        table.c.format >= formats.ANSWER_BY_REFERENCE,
        table.c.status == RunStatus.COMPLETED.value,
    )
    return case((by_reference, answer_of(table.c.run_id)), else_=table.c.result_text).label(
        "result_text"
    )


READ_RUN = (*[c for c in runs.c if c.name != "result_text"], shown_result_text(runs))
"""The `runs` columns as a reader selects them: `result_text` as it is shown."""
