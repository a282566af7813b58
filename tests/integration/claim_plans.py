"""What a claim statement reads: the claim a test makes, caught as it goes to PostgreSQL, made
again under EXPLAIN ANALYZE in a transaction that is undone: planned afresh, or (`kept`) with
the plan the connection that sent it keeps for it."""

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


async def claimed_and_explained(
    engine: AsyncEngine, claim: Awaitable[T], *, kept: bool = False
) -> tuple[T, Any]:
    """What `claim` returned, and the plan (EXPLAIN ANALYZE's root node) of the last claim
    statement it sent through `engine`, made again there on a connection of its own and undone
    (so it leases what the next claim would). `kept`: with the plan that connection keeps for
    the statement (its prepared statement's, EXPLAIN EXECUTE), which is the one its claims run
    with, not one made now; `engine` has one connection, the claim's."""
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
            if kept:
                found = await driver.fetchval(await _executed(driver, statement, parameters))
            else:
                found = await driver.fetchval(
                    f"EXPLAIN (ANALYZE, FORMAT JSON) {statement}", *parameters
                )
        finally:
            await undone.rollback()
    return result, (json.loads(found) if isinstance(found, str) else found)[0]["Plan"]


async def _executed(driver: Any, statement: str, parameters: Any) -> str:
    """EXPLAIN ANALYZE of EXECUTE of `statement`'s prepared statement on `driver`'s connection,
    with `parameters`: EXECUTE takes no parameters of its own, so each value goes through a
    setting local to the transaction, as text, cast back to the statement's type."""
    name, types = await driver.fetchrow(
        "SELECT name, parameter_types::text[] FROM pg_prepared_statements WHERE statement = $1",
        statement,
    )
    arguments = []
    for n, (type_, value) in enumerate(zip(types, parameters, strict=True), start=1):
        if value is None:
            arguments.append(f"NULL::{type_}")
            continue
        kept = f"SELECT set_config('claim_plan.p{n}', $1::{type_}::text, true)"
        await driver.fetchval(kept, value)
        arguments.append(f"current_setting('claim_plan.p{n}')::{type_}")
    return f'EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE "{name}"({", ".join(arguments)})'
