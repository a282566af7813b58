"""Agent caps against the real PostgreSQL: two replicas' claims racing for an agent capped at 3
(here the tenant's `tenants.agent` with `limits.max_running`, routed as a document's is) lease 3
of its runs between them, never more; a queued one reads as held back by that cap; another
tenant's runs lease past its queue; and a run that ends makes room for exactly one more."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from services.admission.domain import FreshnessPolicy
from services.admission.service import Admitter
from services.orchestrator.execution import Execution
from services.orchestrator.repositories import runs as runs_repo
from tests.integration.test_admission import _tenant, chat
from tether.db.schema import runs, tenants

pytestmark = pytest.mark.asyncio(loop_scope="session")

CAP = 3
SLOTS = 8


def _replica(engine: AsyncEngine) -> Execution:
    return Execution.build(engine, None, lease_ttl_s=30, claim_poll_s=60)


async def _queue(admitter: Admitter, tenant: str, count: int) -> list[str]:
    """`count` runs of `tenant`, each its own conversation (each a session head)."""
    return [
        (
            await admitter.admit(chat(f"{tenant}-{i}", tenant=tenant, conversation=f"{tenant}-{i}"))
        ).run.run_id
        for i in range(count)
    ]


async def _running(engine: AsyncEngine, tenant: str) -> int:
    async with engine.connect() as conn:
        stmt = select(func.count()).where(runs.c.tenant_id == tenant, runs.c.status == "running")
        return int((await conn.execute(stmt)).scalar_one())


async def test_two_replicas_racing_lease_no_more_of_a_capped_agent_than_its_cap(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "tcap", "tother")
    async with engine.begin() as conn:
        await conn.execute(
            update(tenants)
            .where(tenants.c.tenant_id == "tcap")
            .values(agent={"agent": "capped", "limits": {"max_running": CAP}})
        )
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    capped = await _queue(admitter, "tcap", 20)
    first, second = _replica(engine), _replica(engine)

    # Six claims of a worker's slots at once, three on each replica, none knowing the cap yet.
    claims = [r.claims.claim_many(f"w-{i}", SLOTS) for i, r in enumerate([first, second] * 3)]
    leased = [c for batch in await asyncio.gather(*claims) for c in batch]
    assert len(leased) == CAP
    assert await _running(engine, "tcap") == CAP
    assert {c.run.run_id for c in leased} <= set(capped)

    # Another tenant's runs, queued after, lease past the capped agent's queue.
    others = await _queue(admitter, "tother", 4)
    more = await first.claims.claim_many("w-other", SLOTS)
    assert sorted(c.run.run_id for c in more) == sorted(others)

    # A queued run of the capped agent reads as held back by its cap, on either replica.
    queued = next(r for r in capped if r not in {c.run.run_id for c in leased})
    async with engine.connect() as conn:
        run = await runs_repo.get_run(conn, "tcap", queued)
    for replica in (first, second):
        assert await replica.claims.held.cap_reached(run.tenant_id, run.run_id) == CAP

    # One of its runs ends: the next claims, racing again, lease exactly one more.
    ended = leased[0]
    async with engine.begin() as conn:
        await conn.execute(
            update(runs).where(runs.c.run_id == ended.run.run_id).values(status="completed")
        )
    again = [r.claims.claim_many(f"w-again-{i}", SLOTS) for i, r in enumerate([first, second] * 2)]
    assert sum(len(batch) for batch in await asyncio.gather(*again)) == 1
    assert await _running(engine, "tcap") == CAP
