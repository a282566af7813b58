"""Counting what a piece of work sends PostgreSQL: every statement, and every BEGIN, COMMIT and
ROLLBACK that reaches the server (an autocommit connection sends none)."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine


class Sent:
    """What was sent while counting: statements in order, and the transaction commands."""

    def __init__(self) -> None:
        self.statements: list[str] = []
        self.commands: collections.Counter[str] = collections.Counter()

    @property
    def total(self) -> int:
        """Statements, BEGINs, COMMITs and ROLLBACKs: each is one round trip."""
        return len(self.statements) + sum(self.commands.values())

    def __repr__(self) -> str:
        heads = [" ".join(s.split())[:70] for s in self.statements]
        return f"Sent(total={self.total}, commands={dict(self.commands)}, statements={heads})"


def _in_transaction(conn: Connection) -> bool:
    # The driver's own flag: an AUTOCOMMIT connection sends no transaction commands at all.
    dbapi: Any = conn.connection.dbapi_connection
    return not dbapi.autocommit


@contextmanager
def counting(engine: AsyncEngine) -> Iterator[Sent]:
    """Count what `engine` sends inside the block."""
    sent = Sent()
    sync = engine.sync_engine

    def on_statement(conn: Connection, cursor: Any, statement: str, *rest: Any) -> None:
        sent.statements.append(statement)

    def on_command(name: str) -> Any:
        def listener(conn: Connection, *rest: Any) -> None:
            if _in_transaction(conn):
                sent.commands[name] += 1

        return listener

    listeners = [
        ("before_cursor_execute", on_statement),
        ("begin", on_command("BEGIN")),
        ("commit", on_command("COMMIT")),
        ("rollback", on_command("ROLLBACK")),
    ]
    for name, fn in listeners:
        event.listen(sync, name, fn)
    try:
        yield sent
    finally:
        for name, fn in listeners:
            event.remove(sync, name, fn)
