"""What the claim reads does not grow with the queue: right after a burst of 300 admissions (the
planner's statistics are older than the burst, as they are on a server until autovacuum comes
round), a claim that leases one run reads a handful of `runs` and `messages` rows. Measured by
EXPLAIN ANALYZE of the claim statement itself, undone."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from services.admission.domain import FreshnessPolicy
from services.admission.service import Admitter
from services.orchestrator.claim_planner import CLAIM_PLANNER
from services.orchestrator.execution import Execution
from tests.integration.claim_plans import claimed_and_explained, rows_read
from tests.integration.test_admission import _tenant, chat
from tether.db.engine import create_engine

pytestmark = pytest.mark.asyncio(loop_scope="session")

QUEUED = 300


async def test_a_claim_right_after_a_burst_reads_what_it_leases_not_the_queue(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "tburst")
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    replica = Execution.build(engine, None, lease_ttl_s=30, claim_poll_s=60)
    names = [f"tburst-{uuid.uuid4().hex[:8]}" for _ in range(QUEUED)]
    for name in names:
        await admitter.admit(chat(name, tenant="tburst", conversation=name))

    # The claim made again (it leases the next run), measured and undone.
    leased, plan = await claimed_and_explained(engine, replica.claims.claim_many("w-burst", 1))
    assert len(leased) == 1
    read = rows_read(plan, {"runs", "messages"})
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
        # The claim made again on the claims' pool (it leases the next run), measured, undone.
        leased, plan = await claimed_and_explained(
            claim_engine, replica.claims.claim_many("w-flood", 1)
        )
    finally:
        await claim_engine.dispose()
    assert len(leased) == 1
    read = rows_read(plan, {"runs"})
    assert read < 30, f"the claim read {read} runs rows, {BURST} queued"


GROWN = 400


async def test_the_claims_pool_keeps_reaching_runs_by_index_after_planning_on_a_tiny_table(
    engine: AsyncEngine, db_url: str
) -> None:
    """A claims' pool connection plans its claim once (CLAIM_PLANNER) and keeps that plan, often
    made on a table of a few runs (a fresh deployment, a replica started early): there, the
    planner found a sequential scan of `runs` cheaper than a primary-key probe for each run it
    leases, and every claim after read the whole table, however large it grew. The plan the
    connection keeps reaches the runs by index."""
    await _tenant(engine, "ttiny")
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    claim_engine = create_engine(db_url, pool_size=1, planner=CLAIM_PLANNER)
    try:
        replica = Execution.build(
            engine, None, lease_ttl_s=30, claim_poll_s=60, claim_engine=claim_engine
        )
        await admitter.admit(chat("ttiny-first", tenant="ttiny", conversation="first"))
        # Planned here, on a table of one run.
        assert len(await replica.claims.claim_many("w-tiny", 1)) == 1
        for n in range(GROWN):
            await admitter.admit(chat(f"ttiny-{n}", tenant="ttiny", conversation=f"t-{n}"))
        leased, plan = await claimed_and_explained(
            claim_engine, replica.claims.claim_many("w-tiny", 1), kept=True
        )
    finally:
        await claim_engine.dispose()
    assert len(leased) == 1
    read = rows_read(plan, {"runs"})
    assert read < 30, f"the claim read {read} runs rows, {GROWN} queued"
