"""What the claim reads does not grow with the queue: right after a burst of 300 admissions (the
planner's statistics are older than the burst, as they are on a server until autovacuum comes
round), a claim that leases one run reads a handful of `runs` and `messages` rows. Measured by
EXPLAIN ANALYZE of the claim statement itself, undone."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

from services.admission.domain import FreshnessPolicy
from services.admission.service import Admitter
from services.orchestrator.claims import CLAIM_PLANNER
from services.orchestrator.execution import Execution
from tests.integration.test_admission import _tenant, chat
from tether.db.engine import create_engine

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


BURST = 5_000


async def test_the_claims_pool_walks_the_fair_index_past_a_burst_no_statistics_saw(
    engine: AsyncEngine, db_url: str
) -> None:
    """On a table whose statistics never saw the queue (none at all here), PostgreSQL reckons
    the claimable runs a handful and, left to choose, reads every one of them through a bitmap
    of ix_runs_fair and sorts them to take the first (5,000 read for 1 leased). The claims' own
    pool plans with `CLAIM_PLANNER`: its claim walks the index in tag order."""
    await _tenant(engine, "tflood")
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())

    async def admit(start: int) -> None:
        for n in range(start, BURST, 8):
            await admitter.admit(chat(f"tflood-{n}", tenant="tflood", conversation=f"f-{n}"))

    await asyncio.gather(*(admit(i) for i in range(8)))
    claim_engine = create_engine(db_url, pool_size=1, planner=CLAIM_PLANNER)
    try:
        replica = Execution.build(
            engine, None, lease_ttl_s=30, claim_poll_s=60, claim_engine=claim_engine
        )
        sent: list[tuple[str, Any]] = []

        def caught(conn: Any, cursor: Any, statement: str, parameters: Any, *args: Any) -> None:
            if "slots" in statement:
                sent.append((statement, parameters))

        event.listen(claim_engine.sync_engine, "before_cursor_execute", caught)
        try:
            assert len(await replica.claims.claim_many("w-flood", 1)) == 1
        finally:
            event.remove(claim_engine.sync_engine, "before_cursor_execute", caught)
        statement, parameters = sent[-1]
        # The same claim again on the claims' pool (it leases the next run), measured and undone.
        async with claim_engine.connect() as conn:
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
    finally:
        await claim_engine.dispose()
    plan = (json.loads(found) if isinstance(found, str) else found)[0]["Plan"]
    read = _rows_read(plan, {"runs"})
    assert read < 30, f"the claim read {read} runs rows, {BURST} queued"
