"""What the engine does with a statement that does not end well. Cancelling a task in the
middle of a statement cancels it: the engine never turns a cancellation into an outage
(`Unavailable`), which would let a stopping service's loops spin on as if PostgreSQL were down.
A statement that fails never quotes its parameters."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from tether.db.direct import Direct
from tether.telemetry.logs import JsonFormatter
from tether.testing.eventually import eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")


_SLEEP = Direct(select(func.pg_sleep(10)))


@pytest.mark.parametrize("path", ["execute", "direct"])
async def test_a_task_cancelled_mid_statement_ends_cancelled(
    engine: AsyncEngine, path: str
) -> None:
    started = asyncio.Event()

    async def sleep_in_postgres() -> None:
        if path == "direct":  # the hot path's statements, on the driver's connection
            async with engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
                started.set()
                await _SLEEP.first(conn, {})
            return
        async with engine.connect() as conn:
            started.set()
            await conn.execute(text("SELECT pg_sleep(10)"))

    task = asyncio.ensure_future(sleep_in_postgres())
    await started.wait()

    async def sleeping() -> bool:
        async with engine.connect() as conn:
            query = "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep%'"
            return bool((await conn.execute(text(query))).scalar())

    await eventually(sleeping, what="the statement to run on the server")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_failed_statement_is_logged_without_what_it_was_given(
    engine: AsyncEngine,
) -> None:
    # Parameters are what people wrote (message text, tool inputs). SQLAlchemy's error lists
    # them all, and PostgreSQL's own message quotes the value it refused; the log line keeps
    # neither, only the error's class and SQLSTATE.
    secret = "a private message 7d1c"
    with pytest.raises(DBAPIError) as failed:
        async with engine.connect() as conn:
            await conn.execute(
                text("SELECT CAST(CAST(:said AS text) AS integer)"), {"said": secret}
            )
    assert "[parameters:" not in str(failed.value)
    record = logging.LogRecord(
        "tether.test",
        logging.ERROR,
        __file__,
        1,
        "admission failed",
        None,
        (type(failed.value), failed.value, failed.value.__traceback__),
    )
    line = json.loads(JsonFormatter("admission").format(record))
    assert secret not in json.dumps(line)
    assert "InvalidTextRepresentation" in line["exception"] and "22P02" in line["exception"]
