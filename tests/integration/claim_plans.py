"""What a claim statement reads: the claim a test makes, caught as it goes to PostgreSQL, made
again under EXPLAIN ANALYZE in a transaction that is undone."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Collection
from typing import Any, TypeVar

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

T = TypeVar("T")


def rows_read(plan: dict[str, Any], tables: Collection[str]) -> int:
    """The rows of `tables` a plan's nodes read: those they returned and those their filters
    passed over, every loop."""
    read = 0
    if plan.get("Relation Name") in tables:
        loops = int(plan.get("Actual Loops", 1))
        read += (int(plan["Actual Rows"]) + int(plan.get("Rows Removed by Filter", 0))) * loops
    for child in plan.get("Plans", []):
        read += rows_read(child, tables)
    return read


async def claimed_and_explained(engine: AsyncEngine, claim: Awaitable[T]) -> tuple[T, Any]:
    """What `claim` returned, and the plan (EXPLAIN ANALYZE's root node) of the last claim
    statement it sent through `engine`, made again there on a connection of its own and undone
    (so it leases what the next claim would)."""
    sent: list[tuple[str, Any]] = []

    def caught(conn: Any, cursor: Any, statement: str, parameters: Any, *args: Any) -> None:
        if "slots" in statement:
            sent.append((statement, parameters))

    event.listen(engine.sync_engine, "before_cursor_execute", caught)
    try:
        result = await claim
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", caught)
    statement, parameters = sent[-1]
    async with engine.connect() as conn:
        driver = (await conn.get_raw_connection()).driver_connection
        assert driver is not None
        undone = driver.transaction()
        await undone.start()
        try:
            found = await driver.fetchval(
                f"EXPLAIN (ANALYZE, FORMAT JSON) {statement}", *parameters
            )
        finally:
            await undone.rollback()
    return result, (json.loads(found) if isinstance(found, str) else found)[0]["Plan"]
