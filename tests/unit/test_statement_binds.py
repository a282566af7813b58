"""No statement of the run aggregate binds a parameter named like a column of a table it
updates. SQLAlchemy takes such a parameter as a value to SET: at the top level it refuses to
compile, but inside a CTE it silently writes the column (a fence's `run_id` or `lease_epoch`
rewritten by the statement meant to check it)."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.dialects.postgresql import asyncpg

from services.admission import repository as admission
from services.orchestrator.repositories import intake, leases, parts, progress, runs, transitions
from tether import states

DIALECT = asyncpg.dialect()


def _statements() -> dict[str, Any]:
    found = {
        "checkpoint": progress.CHECKPOINT.statement,
        "hold_lease": progress._HOLD,
        "renew": leases._RENEW,
        "flag_cancel": runs._FLAG_CANCEL,
        "create_queued_run": intake._CREATE,
        "admit_new": admission.ADMIT_NEW.statement,
        "supersede": parts._SUPERSEDE,
        "end_attempt": leases._END_ATTEMPT,
    }
    for transition in states.TRANSITIONS.values():
        for scoped in (False, True):
            values = {"error": {"code": "x"}, "finished_at": transitions.NOW}
            found[f"{transition.name}/{scoped}"] = transitions._shape(
                transition, scoped, True, values, bound_to_interaction=scoped
            )
    return found


STATEMENTS = _statements()


@pytest.mark.parametrize("name", sorted(STATEMENTS))
def test_binding_every_parameter_sets_nothing_more(name: str) -> None:
    statement = STATEMENTS[name]
    plain = statement.compile(dialect=DIALECT)
    every_bind = list(plain.binds)
    assert str(statement.compile(dialect=DIALECT, column_keys=every_bind)) == str(plain)


def test_the_check_sees_a_parameter_that_would_be_set() -> None:
    from sqlalchemy import bindparam, select, update

    from tether.db.schema import runs as runs_table

    moved = (
        update(runs_table)
        .where(runs_table.c.run_id == bindparam("r"))
        .values(attempt=1)
        .returning(runs_table.c.run_id)
        .cte("m")
    )
    statement = select(moved)
    plain = statement.compile(dialect=DIALECT)
    widened = statement.compile(dialect=DIALECT, column_keys=[*plain.binds, "lease_epoch"])
    assert str(widened) != str(plain)
