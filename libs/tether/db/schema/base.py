"""The schema's one MetaData (with its naming convention) and what every table module shares."""

from __future__ import annotations

from sqlalchemy import (
    Column,
    ColumnElement,
    DateTime,
    MetaData,
    Text,
    func,
    literal,
)

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)


def _now() -> Column[object]:
    return Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now())


def in_state(column: ColumnElement[str], *states: str) -> ColumnElement[bool]:
    """`column` holds one of `states`, written into the SQL as literals: for a search that
    selects rows by their state through that state's partial index (`WHERE status = 'queued'`).

    PostgreSQL proves a partial index's predicate only from the statement's own text. asyncpg
    prepares every statement, and after five runs PostgreSQL may keep a prepared statement's
    generic plan, made without the parameters' values: with `status = $1` that plan cannot use
    the partial index and reads the whole table (the claim read every run ever admitted, once
    per claim). A lookup by key keeps its state a parameter: with the state written in, the
    planner may prefer a small partial index to the key's, and read all of it when its
    statistics are old."""
    written = [literal(str(state), Text, literal_execute=True) for state in states]
    return column == written[0] if len(written) == 1 else column.in_(written)
