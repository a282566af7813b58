"""The completion's PL/pgSQL function is generated from the aggregate's own statements (the lease
fence, the event append, the hand-over, a checkpoint's parts and turns, the attempt's close);
the migration that creates it holds a frozen copy. The copy must be what the generator makes
now: a change to one of those statements needs a migration replacing the function, or the
function would keep running the old rule."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.dialects.postgresql import asyncpg

from services.orchestrator.repositories import completion, history, leases, progress

VERSIONS = Path(__file__).resolve().parents[2] / "libs/tether/db/migrations/versions"
DIALECT = asyncpg.dialect()


def _frozen_copies() -> list[tuple[str, str]]:
    """(migration, COMPLETE_RUN) for every migration that creates the function, oldest first."""
    found = []
    for path in sorted(VERSIONS.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if (
                isinstance(node, ast.Assign)
                and [getattr(t, "id", None) for t in node.targets] == ["COMPLETE_RUN"]
                and isinstance(node.value, ast.Constant)
            ):
                found.append((path.name, str(node.value.value)))
    return found


def test_the_newest_migration_creates_the_function_the_statements_make_now() -> None:
    copies = _frozen_copies()
    assert copies, "a migration creates tether_complete_run"
    name, frozen = copies[-1]
    generated = completion.function_ddl()
    assert frozen.strip() == generated.strip(), (
        f"{name} no longer matches completion.function_ddl(): a statement it is built from "
        "changed; add a migration that replaces the function with the generated text"
    )


def test_the_function_runs_the_one_fence_and_the_one_event_append() -> None:
    ddl = completion.function_ddl()
    # The move's guard and its events' seqs, as transitions writes them for every move.
    assert "runs.status = 'running' AND runs.lease_epoch = _held_epoch" in ddl
    assert "runs.cancel_requested_at IS NULL" in ddl
    assert "(moved.last_seq - coalesce(cardinality(_e_types), 0)) + e.ord" in ddl
    # The session is locked before the search for its next message, in a statement of its own.
    lock = ddl.index("FOR UPDATE\n    INTO _session;")
    assert lock < ddl.index("WITH next_run AS")


NEW_STATEMENTS = {
    "claim": leases.CLAIM.statement,
    "attempt_inputs": history._INPUTS.statement,
    "complete": completion.COMPLETE.statement,
    "batch_parts": progress.PARTS,
    "batch_turns": progress.TURNS,
}


@pytest.mark.parametrize("name", sorted(NEW_STATEMENTS))
def test_binding_every_parameter_of_a_new_statement_sets_nothing_more(name: str) -> None:
    # As tests/unit/test_statement_binds.py: a parameter named like a column of a table the
    # statement writes would be taken as a value to SET.
    statement: Any = NEW_STATEMENTS[name]
    plain = statement.compile(dialect=DIALECT)
    every_bind = list(plain.binds)
    assert str(statement.compile(dialect=DIALECT, column_keys=every_bind)) == str(plain)
