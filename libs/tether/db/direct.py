"""The hot path's statements on the driver's own connection: compiled once by the engine's
dialect, then run with no per-call SQLAlchemy execution.

`AsyncConnection.execute` spends more of the calling process's CPU than PostgreSQL spends
running a small statement: for every call it walks the statement for its cache key, builds an
execution context and a cursor result, and crosses into a greenlet and back. Measured here with
admission's statement at 16 callers: 590 µs of the caller's CPU per call through `execute`,
370 µs for the same SQL and parameters sent on the driver's connection of the same pooled
checkout (275 µs on a bare asyncpg pool; the rest is the pool's checkout, kept).

What is sent is what `execute` would send: the SQL the dialect compiles (its bind casts
included) and the parameters through each bind type's own processor. Rows come back as
SQLAlchemy `Row`s with the statement's column names. The connection stays the pool's: a
statement on an autocommit connection commits alone; on a connection inside `transaction`,
it joins that transaction. A database outage raises `Unavailable` and drops the connection
from the pool, as the engine does for its own statements (`tether.db.engine`).

Only for statements that run many times a second; everything else goes through `execute`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import asyncpg
from sqlalchemy import result_tuple
from sqlalchemy.engine import Dialect, Row
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ClauseElement
from sqlalchemy.sql.expression import Executable

from tether.db.engine import is_outage
from tether.errors import Unavailable


@dataclass(frozen=True)
class _Compiled:
    sql: str
    # Each positional parameter's name and its bind type's processor (None: sent as given).
    binds: tuple[tuple[str, Callable[[Any], Any] | None], ...]
    defaults: Mapping[str, Any]  # values the statement binds itself (literals, defaults)
    required: frozenset[str]  # the parameters a caller must give


class Direct:
    """One statement, run on the driver's connection of a pooled `AsyncConnection`."""

    def __init__(self, statement: Executable) -> None:
        self._statement = statement
        self._compiled: dict[int, _Compiled] = {}  # by dialect instance
        self._row: Callable[[Iterable[Any]], Row[Any]] | None = None

    @property
    def statement(self) -> Executable:
        """The statement as built."""
        return self._statement

    async def first(self, conn: AsyncConnection, params: Mapping[str, Any]) -> Row[Any] | None:
        """The statement's first row, or None."""
        rows = await self._run(conn, params, many=False)
        return rows[0] if rows else None

    async def all(self, conn: AsyncConnection, params: Mapping[str, Any]) -> list[Row[Any]]:
        """Every row the statement returns."""
        return await self._run(conn, params, many=True)

    async def _run(
        self, conn: AsyncConnection, params: Mapping[str, Any], *, many: bool
    ) -> list[Row[Any]]:
        raw = await _pooled(conn)
        driver: asyncpg.Connection = raw.driver_connection
        if not driver.is_in_transaction() and not _autocommit(raw.dbapi_connection):
            # Inside `AsyncConnection.begin()`, whose BEGIN SQLAlchemy sends with its first
            # statement: let it, or this statement would commit alone.
            return list(await conn.execute(self._statement, params))
        sql, args = self.bound(conn.dialect, params)

        async def sent() -> Sequence[asyncpg.Record]:
            if many:
                fetched: Sequence[asyncpg.Record] = await driver.fetch(sql, *args)
                return fetched
            record = await driver.fetchrow(sql, *args)
            return [] if record is None else [record]

        return self._rows(await _heard(conn, driver, sql, args, sent, together=False))

    async def each(
        self, conn: AsyncConnection, params: Sequence[Mapping[str, Any]]
    ) -> list[Row[Any]]:
        """The statement once for each of `params`, in that order, sent together in one round
        trip (asyncpg's `fetchmany`: its binds and executions pipelined, then one Sync) and so
        in one transaction of their own, with no BEGIN or COMMIT: every execution commits, or,
        when one fails, none does and the error is raised. The rows of all of them, in order:
        an execution that returns none adds none, so a caller that needs to know whose a row
        is reads it from the row. On an autocommit `conn` outside a transaction only."""
        if not params:
            return []
        raw = await _pooled(conn)
        driver: asyncpg.Connection = raw.driver_connection
        if driver.is_in_transaction() or not _autocommit(raw.dbapi_connection):
            raise ValueError("statements sent together need an autocommit connection")
        dialect = conn.dialect
        bound = [self.bound(dialect, one) for one in params]
        sql = bound[0][0]
        args = [one_args for _, one_args in bound]

        async def sent() -> Sequence[asyncpg.Record]:
            fetched: Sequence[asyncpg.Record] = await driver.fetchmany(sql, args)
            return fetched

        return self._rows(await _heard(conn, driver, sql, args, sent, together=True))

    def _rows(self, records: Sequence[asyncpg.Record]) -> list[Row[Any]]:
        if not records:
            return []
        if self._row is None:
            self._row = result_tuple(list(records[0].keys()))
        make = self._row
        return [make(record.values()) for record in records]

    def bound(self, dialect: Dialect, params: Mapping[str, Any]) -> tuple[str, list[Any]]:
        """The SQL `dialect`'s driver is sent for this statement and its positional arguments
        for `params`: what `first` and `all` send."""
        compiled = self._compile(dialect)
        missing = compiled.required - params.keys()
        if missing:
            raise ValueError(f"a value is required for {', '.join(sorted(missing))}")
        args = []
        for name, process in compiled.binds:
            value = params[name] if name in params else compiled.defaults[name]
            args.append(value if process is None else process(value))
        return compiled.sql, args

    def _compile(self, dialect: Dialect) -> _Compiled:
        found = self._compiled.get(id(dialect))
        if found is not None:
            return found
        assert isinstance(self._statement, ClauseElement), "a statement compiles"
        compiled = self._statement.compile(dialect=dialect)
        assert isinstance(compiled, SQLCompiler), "a statement compiles to SQL"
        required = {name for name, bind in compiled.binds.items() if bind.required}
        if any(bind.callable is not None for bind in compiled.binds.values()):
            raise ValueError("a value computed per call is for execute, not here")
        expanding = sorted(
            name for name, bind in compiled.binds.items() if bind.expanding and bind.required
        )
        if expanding:
            # Its SQL would change with the length of each call's list.
            raise ValueError(f"{', '.join(expanding)} expands per call; bind an array instead")
        # The statement's own lists (`IN` a fixed set) are rendered once, as execute would.
        state = compiled.construct_expanded_state(dict.fromkeys(required))
        expanded_from = {
            new: name for name, news in state.parameter_expansion.items() for new in news
        }

        def processor(name: str) -> Callable[[Any], Any] | None:
            bind = compiled.binds[expanded_from.get(name, name)]
            return bind.type.dialect_impl(dialect).bind_processor(dialect)

        binds = tuple((name, processor(name)) for name in state.positiontup or ())
        defaults = {name: state.parameters[name] for name, _ in binds if name not in required}
        found = _Compiled(state.statement, binds, defaults, frozenset(required))
        self._compiled[id(dialect)] = found
        return found


@asynccontextmanager
async def transaction(conn: AsyncConnection) -> AsyncIterator[None]:
    """A transaction on the driver's connection of an autocommit `conn`: every statement on
    `conn` inside it, through `Direct` or `execute`, commits with the others or with none."""
    raw = await _pooled(conn)
    if not _autocommit(raw.dbapi_connection):
        raise ValueError("a driver transaction needs an autocommit connection")
    driver: asyncpg.Connection = raw.driver_connection
    try:
        async with driver.transaction():
            yield
    except Exception as exc:
        await _raise_outage(conn, driver, exc)
        raise
    finally:
        if driver.is_in_transaction():
            # Its end never reached the server (cancelled while committing or rolling
            # back): the pool must not hand the open transaction to the next caller.
            await conn.invalidate()


async def _heard(
    conn: AsyncConnection,
    driver: asyncpg.Connection,
    sql: str,
    args: list[Any],
    sent: Callable[[], Awaitable[Sequence[asyncpg.Record]]],
    *,
    together: bool,
) -> Sequence[asyncpg.Record]:
    """`sent()`'s records, the statement heard by what listens to the engine's statements (a
    count, a trace) as `execute`'s are, with no cursor or execution context (there is none;
    `together`: one set of values per run, as an executemany); an outage raised as the
    engine raises it."""
    sync = conn.sync_connection
    heard = sync if sync is not None and sync.dispatch.before_cursor_execute else None
    if heard is not None:
        heard.dispatch.before_cursor_execute(heard, None, sql, args, None, together)
    try:
        records = await sent()
    except Exception as exc:
        await _raise_outage(conn, driver, exc)
        raise
    if heard is not None:
        heard.dispatch.after_cursor_execute(heard, None, sql, args, None, together)
    return records


async def _pooled(conn: AsyncConnection) -> PoolProxiedConnection:
    """`conn`'s pooled connection. While it is checked out and valid it is read as is:
    `get_raw_connection` crosses into a greenlet and back for it (10 µs a call here), which only
    reconnecting an invalidated connection needs."""
    sync = conn.sync_connection
    if sync is not None and not (sync.closed or sync.invalidated):
        return sync.connection
    return await conn.get_raw_connection()


def _autocommit(adapted: Any) -> bool:
    # SQLAlchemy's adapted DBAPI connection says whether `isolation_level="AUTOCOMMIT"` is set.
    return bool(adapted.autocommit)


async def _raise_outage(conn: AsyncConnection, driver: asyncpg.Connection, exc: Exception) -> None:
    """An outage raises `Unavailable` and drops the connection from the pool, as the engine's
    own `handle_error` does; any other error is left to propagate as the driver's. As for the
    engine, an error that leaves the connection closed is an outage whatever it says (the
    server ending a session can surface as the driver's own protocol error)."""
    if is_outage(exc) or driver.is_closed():
        await conn.invalidate(exc)
        raise Unavailable.outage("PostgreSQL") from exc
