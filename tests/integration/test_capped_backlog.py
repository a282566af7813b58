"""A capped tenant's held backlog costs the claim nothing: a tenant at its cap (tenants.max_running)
with hundreds of runs queued, and another tenant's runs queued after them, the claim leases the
other tenant's runs, and its statement visits a handful of `runs` rows, not the held ones (its
slots come from a scan that holds no capped tenant's runs, and a capped tenant's from a probe of
its own, as many as its room). So does an agent's at its cap (`limits.max_running`), once a
claim has met it: its runs are marked held, out of the scans, and probed while it has room."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from services.admission.domain import FreshnessPolicy
from services.admission.service import Admitter
from services.orchestrator.caps import CapWatch
from services.orchestrator.claim_planner import CLAIM_PLANNER
from services.orchestrator.execution import Execution
from tests.integration.claim_plans import claimed_and_explained, rows_read
from tests.integration.test_admission import _tenant, chat
from tether.db.engine import create_engine
from tether.db.schema import runs, tenants

pytestmark = pytest.mark.asyncio(loop_scope="session")

HELD = 300
SLOTS = 8


async def _queue(admitter: Admitter, tenant: str, count: int) -> list[str]:
    """`count` runs of `tenant`, each its own conversation (each a session head)."""
    names = [f"{tenant}-{uuid.uuid4().hex[:8]}" for _ in range(count)]
    return [
        (await admitter.admit(chat(name, tenant=tenant, conversation=name))).run.run_id
        for name in names
    ]


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
    async with engine.connect() as conn:
        # The statistics autovacuum would have gathered by now on a server under such a load.
        await conn.exec_driver_sql("ANALYZE")

    # The claim made again, now with nothing to lease but the held runs, measured and undone.
    leased, plan = await claimed_and_explained(engine, replica.claims.claim_many("w-2", SLOTS))
    assert sorted(c.run.run_id for c in leased) == sorted(quiet)
    visited = rows_read(plan, {"runs"})
    assert visited < HELD // 10, f"the claim read {visited} runs rows past {HELD} held"


AGENT_CAPPED = {"agent": "capped", "limits": {"max_running": 1}}


async def _agent_capped(engine: AsyncEngine, tenant: str, agent: dict[str, object]) -> None:
    async with engine.begin() as conn:
        await conn.execute(update(tenants).where(tenants.c.tenant_id == tenant).values(agent=agent))


async def test_an_agents_held_backlog_is_not_read_by_the_claim_once_one_met_it(
    engine: AsyncEngine, db_url: str
) -> None:
    await _tenant(engine, "aheld", "aquiet")
    await _agent_capped(engine, "aheld", AGENT_CAPPED)
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    # The claims on a pool of their own, as the orchestrator's (`CLAIM_PLANNER`).
    claim_engine = create_engine(db_url, pool_size=1, planner=CLAIM_PLANNER)
    try:
        replica = Execution.build(
            engine, None, lease_ttl_s=30, claim_poll_s=60, claim_engine=claim_engine
        )
        (running,) = await _queue(admitter, "aheld", 1)
        assert [c.run.run_id for c in await replica.claims.claim_many("w-1", SLOTS)] == [running]
        await _queue(admitter, "aheld", HELD)  # held: the agent runs as many as its cap
        first = await _queue(admitter, "aquiet", 2)
        # The claim that meets the held runs leases the other tenant's.
        met = await replica.claims.claim_many("w-2", SLOTS)
        assert sorted(c.run.run_id for c in met) == sorted(first)
        await replica.claims.held.done()  # its agent's other held runs, marked meanwhile
        quiet = await _queue(admitter, "aquiet", 2)
        async with engine.connect() as conn:
            await conn.exec_driver_sql("ANALYZE")

        leased, plan = await claimed_and_explained(
            claim_engine, replica.claims.claim_many("w-3", SLOTS)
        )
        assert sorted(c.run.run_id for c in leased) == sorted(quiet)
        visited = rows_read(plan, {"runs"})
        assert visited < HELD // 10, f"the claim read {visited} runs rows past {HELD} held"

        # A run of the agent's queued since is marked by the claim that meets it.
        later = await _queue(admitter, "aheld", 1)
        (another,) = await _queue(admitter, "aquiet", 1)
        assert [c.run.run_id for c in await replica.claims.claim_many("w-4", SLOTS)] == [another]
        assert await _held_for(engine, later) == ["capped"]
    finally:
        await claim_engine.dispose()


async def _flags(engine: AsyncEngine, run_ids: list[str]) -> list[bool]:
    async with engine.connect() as conn:
        found = await conn.execute(
            select(runs.c.run_id, runs.c.capped).where(runs.c.run_id.in_(run_ids))
        )
        flags = {row.run_id: row.capped for row in found}
    return [flags[r] for r in run_ids]


async def _cap(engine: AsyncEngine, tenant: str, cap: int | None) -> None:
    async with engine.begin() as conn:
        await conn.execute(
            update(tenants).where(tenants.c.tenant_id == tenant).values(max_running=cap)
        )


async def test_the_runs_flags_follow_their_tenants_cap_and_no_run_is_stranded(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "tflip")
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    woken: list[bool] = []
    caps = CapWatch(engine, changed=lambda: woken.append(True))
    queued = await _queue(admitter, "tflip", 3)
    assert await _flags(engine, queued) == [False] * 3
    await caps.read()
    woken.clear()

    # A cap set on a tenant with runs queued: they are flagged, and the claims woken.
    await _cap(engine, "tflip", 2)
    assert await caps.read() == {"tflip"}
    assert await _flags(engine, queued) == [True] * 3 and woken
    # A run queued from then on is flagged as it is queued.
    (later,) = await _queue(admitter, "tflip", 1)
    assert await _flags(engine, [later]) == [True]

    # The cap removed: the flags are cleared; a run an admission flagged as the cap went (it
    # read the cap before) is cleared at the next read, though the caps did not change again.
    await _cap(engine, "tflip", None)
    woken.clear()
    assert await caps.read() == set()
    assert await _flags(engine, [*queued, later]) == [False] * 4 and woken
    async with engine.begin() as conn:
        await conn.execute(update(runs).where(runs.c.run_id == later).values(capped=True))
    woken.clear()
    await caps.read()
    assert await _flags(engine, [later]) == [False] and woken

    # None is stranded: an uncapped tenant's claim leases every one.
    replica = Execution.build(engine, None, lease_ttl_s=30, claim_poll_s=60)
    await replica.claims.caps.read()
    leased = await replica.claims.claim_many("w-flip", SLOTS)
    assert sorted(c.run.run_id for c in leased) == sorted([*queued, later])


async def _held_for(engine: AsyncEngine, run_ids: list[str]) -> list[str | None]:
    async with engine.connect() as conn:
        found = await conn.execute(
            select(runs.c.run_id, runs.c.held_agent).where(runs.c.run_id.in_(run_ids))
        )
        held = {row.run_id: row.held_agent for row in found}
    return [held[r] for r in run_ids]


async def test_runs_held_for_an_agent_are_reached_by_a_new_replica_and_freed_with_its_cap(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "asettle")
    await _agent_capped(engine, "asettle", AGENT_CAPPED)
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    first = Execution.build(engine, None, lease_ttl_s=30, claim_poll_s=60)
    (running,) = await _queue(admitter, "asettle", 1)
    assert [c.run.run_id for c in await first.claims.claim_many("w-1", SLOTS)] == [running]
    held = await _queue(admitter, "asettle", 5)
    assert await first.claims.claim_many("w-1", SLOTS) == []
    await first.claims.held.done()
    assert await _held_for(engine, held) == ["capped"] * 5

    # A replica that never routed the tenant (one restarted) routes one of the held runs before
    # anything else, learns the cap, and leaves the marks: its claims reach them by the probe.
    second = Execution.build(engine, None, lease_ttl_s=30, claim_poll_s=60)
    assert await second.claims.held.settle() == 0
    assert await _held_for(engine, held) == ["capped"] * 5
    await _agent_capped(engine, "asettle", {"agent": "capped", "limits": {"max_running": 2}})
    assert await second.claims.held.settle() == 0  # still capped, at 2 now
    # Room for one more: the oldest held run, by the agent's probe.
    assert [c.run.run_id for c in await second.claims.claim_many("w-2", SLOTS)] == held[:1]
    assert await _held_for(engine, held[:1]) == [None]  # its lease cleared the mark

    # The cap lifted: the marks are cleared, and every run is the claim's again.
    await _agent_capped(engine, "asettle", {"agent": "capped"})
    assert await first.claims.held.settle() == 4
    assert await _held_for(engine, held[1:]) == [None] * 4
    leased = await first.claims.claim_many("w-1", SLOTS)
    assert sorted(c.run.run_id for c in leased) == sorted(held[1:])


async def test_a_run_queued_beside_an_agents_held_backlog_is_not_tagged_behind_it(
    engine: AsyncEngine,
) -> None:
    """The queue's virtual time counts the runs an agent's cap holds back (as it did while they
    sat in the fair scan): a quiet tenant's run queued beside them starts level with their head,
    and takes turns with them once the agent has room, instead of behind every one of them (a
    capped flood would then take each slot its own runs free, ahead of it: the drill's
    quiet_runs_waiting_past_bound)."""
    await _tenant(engine, "aflood", "aquiet2")
    await _agent_capped(engine, "aflood", AGENT_CAPPED)
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    replica = Execution.build(engine, None, lease_ttl_s=30, claim_poll_s=60)
    (running,) = await _queue(admitter, "aflood", 1)
    assert [c.run.run_id for c in await replica.claims.claim_many("w-1", SLOTS)] == [running]
    held = await _queue(admitter, "aflood", 20)
    assert await replica.claims.claim_many("w-1", SLOTS) == []
    await replica.claims.held.done()
    assert await _held_for(engine, held) == ["capped"] * 20

    (quiet,) = await _queue(admitter, "aquiet2", 1)
    async with engine.connect() as conn:
        tags = dict(
            (
                await conn.execute(
                    select(runs.c.run_id, runs.c.fair_key).where(runs.c.run_id.in_([*held, quiet]))
                )
            ).all()
        )
    assert tags[quiet] <= min(tags[r] for r in held), (tags[quiet], sorted(tags[r] for r in held))
