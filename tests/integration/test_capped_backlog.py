"""A capped tenant's held backlog costs the claim nothing: a tenant at its cap (tenants.max_running)
with hundreds of runs queued, and another tenant's runs queued after them, the claim leases the
other tenant's runs, and its statement visits a handful of `runs` rows, not the held ones (its
slots come from a scan that holds no capped tenant's runs, and a capped tenant's from a probe of
its own, as many as its room)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import event, update
from sqlalchemy.ext.asyncio import AsyncEngine

from services.admission.domain import FreshnessPolicy
from services.admission.service import Admitter
from services.orchestrator.execution import Execution
from tests.integration.test_admission import _tenant, chat
from tether.db.schema import tenants

pytestmark = pytest.mark.asyncio(loop_scope="session")

HELD = 300
SLOTS = 8


async def _queue(admitter: Admitter, tenant: str, count: int) -> list[str]:
    """`count` runs of `tenant`, each its own conversation (each a session head)."""
    return [
        (
            await admitter.admit(chat(f"{tenant}-{i}", tenant=tenant, conversation=f"{tenant}-{i}"))
        ).run.run_id
        for i in range(count)
    ]


def _rows_visited(plan: dict[str, Any]) -> int:
    """The `runs` rows a plan's nodes read: those they returned and those their filters passed
    over, every loop."""
    visited = 0
    if plan.get("Relation Name") == "runs":
        loops = int(plan.get("Actual Loops", 1))
        visited += (int(plan["Actual Rows"]) + int(plan.get("Rows Removed by Filter", 0))) * loops
    for child in plan.get("Plans", []):
        visited += _rows_visited(child)
    return visited


async def test_a_capped_tenants_held_backlog_is_not_read_by_the_claim(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "theld", "tquiet")
    async with engine.begin() as conn:
        await conn.execute(
            update(tenants).where(tenants.c.tenant_id == "theld").values(max_running=1)
        )
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    replica = Execution.build(engine, None, lease_ttl_s=30, claim_poll_s=60)
    await replica.claims.caps.read()
    (running,) = await _queue(admitter, "theld", 1)
    assert [c.run.run_id for c in await replica.claims.claim_many("w-1", SLOTS)] == [running]
    await _queue(admitter, "theld", HELD)  # held: the tenant runs as many as its cap
    quiet = await _queue(admitter, "tquiet", 2)

    sent: list[tuple[str, Any]] = []

    def caught(conn: Any, cursor: Any, statement: str, parameters: Any, *args: Any) -> None:
        if "slots" in statement:
            sent.append((statement, parameters))

    event.listen(engine.sync_engine, "before_cursor_execute", caught)
    try:
        leased = await replica.claims.claim_many("w-2", SLOTS)
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", caught)
    assert sorted(c.run.run_id for c in leased) == sorted(quiet)
    statement, parameters = sent[-1]

    # The same claim again, now with nothing to lease but the held runs, measured and undone.
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
    plan = json.loads(found)[0]["Plan"] if isinstance(found, str) else found[0]["Plan"]
    visited = _rows_visited(plan)
    assert visited < HELD // 10, f"the claim read {visited} runs rows past {HELD} held"
