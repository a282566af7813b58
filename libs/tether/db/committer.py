"""Group commit: writes that arrive together share one transaction, so one commit (one WAL
flush) serves them all; a write that arrives alone is written at once. The run aggregate's
checkpoints and completions go through one (`services.orchestrator.attempts`), admissions
through another (`services.admission.service`).

A write is one statement, so alone it needs no transaction of its own: it runs on an autocommit
connection, with no BEGIN or COMMIT round trip. At most `writers` transactions are open at once;
a write that finds one free starts writing at once, taking every write waiting then (those
that arrived in the same turn of the event loop ride along); one that finds none waits in line,
and the next writer to finish takes the whole line in one transaction. Nothing is ever held
back for a timer. Within a group, writes run in key order (the run id; an admission's session
and claim), so two groups lock the rows they share in one order.

A group whose writes are all the same one statement (`write_statement`: completions,
checkpoints, admissions) needs no transaction commands either: the statement is sent once for
each, in key order, together in one round trip (`Direct.each`), which PostgreSQL runs as one
transaction. A group of mixed writes is written in a transaction, BEGIN and COMMIT around its
statements.

One write's failure fails only that write: a stale lease is a result, not an error, and when a
statement fails the group's transaction is rolled back and each of its writes is written again
alone, so the one that fails fails by itself. A write is therefore written with no side effect
but its statement; its caller publishes once the result is in. Writes are shielded from their
callers' cancellation (a group is written whole, whoever went away), unless the committer is
`cancellable`: then a write whose caller goes away before it commits is not written; a group
it went with is stopped (its statements cancelled and rolled back) and written again without
it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tether.db import direct
from tether.db.direct import Direct

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")
# What `_watched` gives back for writing stopped because a caller went away.
_GONE: Any = object()


@dataclass(frozen=True)
class Prepared(Generic[T]):
    """A write that is one `Direct` statement: the values it binds, and what the caller needs
    from the row it returns (None when it returns none)."""

    params: Mapping[str, Any]
    read: Callable[[Row[Any] | None], T]


# What makes a `Prepared` write, on the connection it will be written on (a read it needs first,
# such as a run's prices, goes there).
Prepare = Callable[[AsyncConnection], Awaitable[Prepared[T]]]


@dataclass(frozen=True)
class _Pending:
    key: str  # its place in its group
    direct: Direct
    prepare: Prepare[Any]
    matched_by: str  # the column of its statement's rows that names the write
    match: str  # the value that column holds in this write's row
    result: asyncio.Future[Any]

    async def write(self, conn: AsyncConnection) -> Any:
        """The write on its own on `conn` (alone, or in a group's transaction)."""
        prepared = await self.prepare(conn)
        return prepared.read(await self.direct.first(conn, prepared.params))


class Committer:
    """Writes statements, together when they arrive together."""

    # Enough writers that one write waiting on a row lock does not hold up the others; few
    # enough that writes arriving while they are busy queue up and share a commit.
    def __init__(self, engine: AsyncEngine, *, writers: int = 4, cancellable: bool = False) -> None:
        if writers < 1:
            raise ValueError("a committer needs at least one writer")
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._cancellable = cancellable
        self._line: collections.deque[_Pending] = collections.deque()
        self._free = writers
        self._writing: set[asyncio.Task[None]] = set()

    @property
    def waiting(self) -> int:
        """Writes in line for the next transaction."""
        return len(self._line)

    async def write_statement(
        self,
        key: str,
        statement: Direct,
        prepare: Prepare[T],
        *,
        matched_by: str,
        match: str | None = None,
    ) -> T:
        """The result of a write that is one run of `statement` (`prepare` says with what, and
        what comes of its row), once it is committed with whatever else was waiting; `key`
        orders it within its group (the run it writes). A group of writes of one statement is
        sent in one round trip with no transaction commands. The row a write's statement
        returns names it in its column `matched_by`, by `match` (its key unless given); writes
        of a group that name the same value go in a transaction instead."""
        result: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        named = key if match is None else match
        self._line.append(_Pending(key, statement, prepare, matched_by, named, result))
        if self._free:
            self._free -= 1
            task = asyncio.create_task(self._write_groups(), name="group-commit")
            self._writing.add(task)
            task.add_done_callback(self._writing.discard)
        if self._cancellable:
            # The caller going away cancels `result`: the writer sees it (`_watched`).
            return await result
        return await asyncio.shield(result)

    async def _write_groups(self) -> None:
        """Write the line, a group per transaction, until it is empty; then free the writer."""
        try:
            while self._line:
                # Not a timer: one turn of the loop, so writes that arrived with this one go
                # in its transaction rather than start their own.
                await asyncio.sleep(0)
                if not self._line:
                    break  # a writer started in the same turn took the line whole
                # A write whose caller went away while it waited is not written.
                group = sorted((p for p in self._line if not p.result.done()), key=_key)
                self._line.clear()
                if group:
                    await self._write_group(group)
        finally:
            self._free += 1

    async def _write_group(self, group: list[_Pending]) -> None:
        if len(group) == 1:
            await self._write_alone(group[0])
            return

        async def written() -> list[Any]:
            async with self._autocommit.connect() as conn:
                if _one_statement(group):
                    return await _together(conn, group)
                async with direct.transaction(conn):
                    return [await pending.write(conn) for pending in group]

        try:
            results = await self._watched(group, written)
        except asyncio.CancelledError:
            _cancel(group)
            raise
        except Exception:
            # Rolled back: nothing of the group was written. Alone, each write that can land
            # lands, and the one that failed fails by itself.
            log.info("a group of %d writes failed; writing each alone", len(group))
            await asyncio.gather(*(self._write_alone(pending) for pending in group))
            return
        if results is _GONE:
            # Stopped before it committed, for a caller that went away: the rest go again.
            rest = [pending for pending in group if not pending.result.done()]
            if rest:
                await self._write_group(rest)
            return
        for pending, result in zip(group, results, strict=True):
            if not pending.result.done():
                pending.result.set_result(result)

    async def _write_alone(self, pending: _Pending) -> None:
        async def written() -> Any:
            async with self._autocommit.connect() as conn:
                return await pending.write(conn)

        try:
            result = await self._watched([pending], written)
        except asyncio.CancelledError:
            _cancel([pending])
            raise
        except Exception as exc:
            if not pending.result.done():
                pending.result.set_exception(exc)
        else:
            if not pending.result.done() and result is not _GONE:
                pending.result.set_result(result)

    async def _watched(self, group: list[_Pending], written: Callable[[], Awaitable[R]]) -> R | Any:
        """`written()`; in a cancellable committer, stopped when a caller of `group` goes away
        before it ends (its statements cancelled and rolled back, unless they had committed):
        then _GONE."""
        if not self._cancellable:
            return await written()
        writing: asyncio.Future[Any] = asyncio.ensure_future(written())
        gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def went(result: asyncio.Future[Any]) -> None:
            if result.cancelled() and not gone.done():
                gone.set_result(None)

        for pending in group:
            pending.result.add_done_callback(went)
        try:
            await asyncio.wait([writing, gone], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            writing.cancel()
            raise
        finally:
            for pending in group:
                pending.result.remove_done_callback(went)
        if writing.done():
            return writing.result()
        writing.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await writing
        return _GONE


def _key(pending: _Pending) -> str:
    return pending.key


def _one_statement(group: list[_Pending]) -> bool:
    """Whether `group` is runs of one statement, each naming its row by a value of its own."""
    first = group[0].direct
    return all(p.direct is first for p in group) and len({p.match for p in group}) == len(group)


async def _together(conn: AsyncConnection, group: list[_Pending]) -> list[Any]:
    """The group's statement sent once for each write, in one round trip; each write's result
    from the row that names it."""
    prepared = [await pending.prepare(conn) for pending in group]
    one = group[0]
    rows = await one.direct.each(conn, [p.params for p in prepared])
    by_match = {str(row._mapping[one.matched_by]): row for row in rows}
    return [p.read(by_match.get(pending.match)) for pending, p in zip(group, prepared, strict=True)]


def _cancel(group: list[_Pending]) -> None:
    for pending in group:
        pending.result.cancel()
