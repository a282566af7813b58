"""Fair leases against the real PostgreSQL: tenants share the leases by weight whatever backlog
one of them has queued first, a tenant that queues its first run gets it leased in the next
claim, and a run's priority orders it within its own tenant (never against another tenant)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from services.admission.domain import FreshnessPolicy
from services.admission.service import Admitter
from services.orchestrator.execution import Execution
from tests.integration.test_admission import _tenant, chat
from tether import priorities
from tether.db.schema import runs, tenants

pytestmark = pytest.mark.asyncio(loop_scope="session")

SLOTS = 8  # a worker's runs at once: the claims below lease this many at a time


def _execution(engine: AsyncEngine) -> Execution:
    return Execution.build(engine, None, lease_ttl_s=30, claim_poll_s=60)


async def _queue(
    admitter: Admitter, tenant: str, count: int, *, priority: str = "normal"
) -> list[str]:
    """`count` runs of `tenant`, each its own conversation (each a session head)."""
    rank = priorities.rank(priority)
    return [
        (
            await admitter.admit(
                replace(
                    chat(
                        f"{tenant}-{priority}-{i}",
                        tenant=tenant,
                        conversation=f"{tenant}-{priority}-{i}",
                    ),
                    priority=rank,
                )
            )
        ).run.run_id
        for i in range(count)
    ]


async def _weigh(engine: AsyncEngine, weights: dict[str, int]) -> None:
    await _tenant(engine, *weights)
    async with engine.begin() as conn:
        for tenant, weight in weights.items():
            await conn.execute(
                update(tenants).where(tenants.c.tenant_id == tenant).values(weight=weight)
            )


async def test_tenants_share_the_leases_by_weight_behind_one_tenants_backlog(
    engine: AsyncEngine,
) -> None:
    await _weigh(engine, {"ta": 1, "tb": 1, "tc": 2})
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    execution = _execution(engine)
    await _queue(admitter, "ta", 250)
    # The pool is busy with A's runs when B and C queue theirs.
    busy = await execution.claims.claim_many("w-busy", SLOTS)
    assert {c.run.tenant_id for c in busy} == {"ta"}
    b_runs = await _queue(admitter, "tb", 50)
    c_runs = await _queue(admitter, "tc", 100)

    first = await execution.claims.claim_many("w-0", SLOTS)
    leased = [c.run.run_id for c in first]
    # B's and C's first runs go in the very next claim, not behind A's 242 queued runs.
    assert b_runs[0] in leased and c_runs[0] in leased, [c.run.tenant_id for c in first]

    # The contended window: every tenant still has runs queued (B's 50 last the longest at a
    # quarter of the leases: 160 leases leave it some).
    tenant_of = [c.run.tenant_id for c in first]
    while len(tenant_of) < 160:
        tenant_of += [c.run.tenant_id for c in await execution.claims.claim_many("w", SLOTS)]
    shares = Counter(tenant_of[:160])
    for tenant, weight_share in {"ta": 0.25, "tb": 0.25, "tc": 0.5}.items():
        share = shares[tenant] / 160
        assert abs(share - weight_share) / weight_share <= 0.10, (tenant, share, shares)


async def test_a_tenants_priorities_order_its_own_runs_and_no_one_elses(
    engine: AsyncEngine,
) -> None:
    await _weigh(engine, {"t1": 1, "t2": 1})
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    execution = _execution(engine)
    low = await _queue(admitter, "t1", 2, priority="low")
    normal = await _queue(admitter, "t1", 3)
    other = await _queue(admitter, "t2", 4)
    high = await _queue(admitter, "t1", 2, priority="high")
    async with engine.connect() as conn:
        stored = dict((await conn.execute(select(runs.c.run_id, runs.c.priority))).all())
    assert [stored[r] for r in (*high, *normal, *low)] == [0, 0, 1, 1, 1, 2, 2]

    order = []
    for _ in range(11):
        [one] = await execution.claims.claim_many("w", 1)
        order.append(one.run.run_id)
    t1 = [r for r in order if r not in other]
    # Within t1: high first (oldest first), then normal, then low, whatever their age.
    assert t1 == [*high, *normal, *low]
    # Across tenants the turns alternate as the tags say (equal tags in either order): t1's
    # priorities took t1's turns only.
    assert [{r in other for r in order[i : i + 2]} for i in range(0, 8, 2)] == [{False, True}] * 4


async def test_an_unknown_priority_is_refused_before_anything_is_written() -> None:
    with pytest.raises(Exception) as refused:
        priorities.rank("urgent")
    assert type(refused.value).__name__ == "InvalidArgument"
    assert "high, normal, low" in str(refused.value)
