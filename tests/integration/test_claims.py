"""Claims against the real PostgreSQL: a wake-up that never arrives is made up for by the
replica's one poll, not by each waiting claim's own; a claim that will not wait always looks."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from services.admission.domain import FreshnessPolicy
from services.admission.service import Admitter
from services.orchestrator.execution import Execution
from tests.integration.test_admission import _tenant, chat
from tether.testing.eventually import eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_a_claim_waiting_when_its_wake_up_is_lost_gets_the_run_from_the_poll(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "t1")
    # No bus on either side: admission's wake-up never goes out, as when Redis loses it.
    execution = Execution.build(engine, None, lease_ttl_s=30, claim_poll_s=0.05)
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    poll = asyncio.create_task(execution.claims.poll_claimable())
    claim = asyncio.create_task(execution.claims.claim("w-1", wait_s=60))
    try:

        async def in_line() -> bool | None:
            return True if execution.publisher.wakeups.waiting == 1 else None

        await eventually(in_line, what="the claim to find nothing and wait")
        run_id = (await admitter.admit(chat("e-lost", conversation="c-lost"))).run.run_id
        # The claim would otherwise wait out its 60 s; the poll runs every 50 ms.
        claimed = await asyncio.wait_for(claim, 10)
        assert claimed is not None and claimed.run.run_id == run_id
        assert execution.publisher.wakeups.waiting == 0
    finally:
        for task in (poll, claim):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_a_claim_that_will_not_wait_always_looks(engine: AsyncEngine) -> None:
    await _tenant(engine, "t1")
    execution = Execution.build(engine, None, lease_ttl_s=30, claim_poll_s=60)
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    assert await execution.claims.claim("w-1", wait_s=0) is None  # the queue is empty
    # Admitted with no wake-up at all (no bus): a claim that waits for nothing still finds it.
    run_id = (await admitter.admit(chat("e-quiet", conversation="c-quiet"))).run.run_id
    claimed = await execution.claims.claim("w-2", wait_s=0)
    assert claimed is not None and claimed.run.run_id == run_id
