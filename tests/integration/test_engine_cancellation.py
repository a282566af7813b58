"""Cancelling a task in the middle of a statement cancels it: the engine never turns a
cancellation into an outage (`Unavailable`), which would let a stopping service's loops spin on
as if PostgreSQL were down."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tether.testing.eventually import eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_a_task_cancelled_mid_statement_ends_cancelled(engine: AsyncEngine) -> None:
    started = asyncio.Event()

    async def sleep_in_postgres() -> None:
        async with engine.connect() as conn:
            started.set()
            await conn.execute(text("SELECT pg_sleep(10)"))

    task = asyncio.ensure_future(sleep_in_postgres())
    await started.wait()

    async def sleeping() -> bool:
        async with engine.connect() as conn:
            query = "SELECT count(*) FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(10)'"
            return bool((await conn.execute(text(query))).scalar())

    await eventually(sleeping, what="the statement to run on the server")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
