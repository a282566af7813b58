"""What the claim reads does not grow with the queue: right after a burst of 300 admissions (the
planner's statistics are older than the burst, as they are on a server until autovacuum comes
round), a claim that leases one run reads a handful of `runs` and `messages` rows. Measured by
EXPLAIN ANALYZE of the claim statement itself, undone."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

from services.admission.domain import FreshnessPolicy
from services.admission.service import Admitter
from services.orchestrator.execution import Execution
from tests.integration.test_admission import _tenant, chat

pytestmark = pytest.mark.asyncio(loop_scope="session")

QUEUED = 300


def _rows_read(plan: dict[str, Any], tables: set[str]) -> int:
    """The rows of `tables` a plan's nodes read: those they returned and those their filters
    passed over, every loop."""
    read = 0
    if plan.get("Relation Name") in tables:
        loops = int(plan.get("Actual Loops", 1))
        read += (int(plan["Actual Rows"]) + int(plan.get("Rows Removed by Filter", 0))) * loops
    for child in plan.get("Plans", []):
        read += _rows_read(child, tables)
    return read


async def test_a_claim_right_after_a_burst_reads_what_it_leases_not_the_queue(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "tburst")
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    replica = Execution.build(engine, None, lease_ttl_s=30, claim_poll_s=60)
    names = [f"tburst-{uuid.uuid4().hex[:8]}" for _ in range(QUEUED)]
    for name in names:
        await admitter.admit(chat(name, tenant="tburst", conversation=name))

    sent: list[tuple[str, Any]] = []

    def caught(conn: Any, cursor: Any, statement: str, parameters: Any, *args: Any) -> None:
        if "slots" in statement:
            sent.append((statement, parameters))

    event.listen(engine.sync_engine, "before_cursor_execute", caught)
    try:
        leased = await replica.claims.claim_many("w-burst", 1)
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", caught)
    assert len(leased) == 1
    statement, parameters = sent[-1]

    # The same claim again (it leases the next run), measured and undone.
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
    plan = (json.loads(found) if isinstance(found, str) else found)[0]["Plan"]
    read = _rows_read(plan, {"runs", "messages"})
    assert read < QUEUED // 10, f"the claim read {read} runs and messages rows, {QUEUED} queued"
