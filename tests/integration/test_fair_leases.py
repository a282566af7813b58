"""Fair leases against the real PostgreSQL: tenants share the leases by weight whatever backlog
one of them has queued first, a tenant that queues its first run gets it leased in the next
claim, and a run's priority orders it within its own tenant (never against another tenant);
one tenant's admissions take their tags without waiting for each other's commits."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.admission import repository as admission
from services.admission.domain import FreshnessPolicy
from services.admission.service import Admitter
from services.orchestrator.execution import Execution
from services.orchestrator.repositories.fair_tags import STRIPES
from tests.integration.statements import counting
from tests.integration.test_admission import _tenant, chat
from tether import priorities
from tether.db.schema import runs, tenants
from tether.domain import RunError
from tether.ids import new_id
from tether.ratelimits import RATE_LIMITED

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


async def test_runs_waiting_to_be_leased_again_do_not_set_a_newcomers_place(
    engine: AsyncEngine,
) -> None:
    """A run leased once and queued again (here: a call refused by the model rate limit, whose
    run waits retry-pending and keeps its start tag) was already served its turn: a tenant that
    queues now starts level with the runs not yet leased, not with the one waiting again."""
    await _weigh(engine, {"ra": 1, "rb": 1})
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    execution = _execution(engine)
    await _queue(admitter, "ra", 20)
    leased = await execution.claims.claim_many("w", SLOTS)  # A's tags 0 to 7
    for claimed in leased:
        await execution.recovery.schedule_retry(
            claimed.run.run_id,
            claimed.lease.run.lease_epoch,
            RunError(code=RATE_LIMITED, message="the bucket is empty", retryable=True),
            0.0,
        )
    assert await execution.recovery.queue_due_retries() == SLOTS  # queued again, tags kept

    [b_run] = await _queue(admitter, "rb", 1)
    async with engine.connect() as conn:
        tag = (
            await conn.execute(select(runs.c.fair_key).where(runs.c.run_id == b_run))
        ).scalar_one()
    # A's next run not yet leased has tag 8: B's first starts there, not at 0 (which would
    # put B's first eight runs ahead of every run of A's not yet leased).
    assert tag == SLOTS


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


async def _until_waiting(engine: AsyncEngine, admission: asyncio.Task[Any]) -> None:
    """Return once a statement of the test's database waits for a lock (`admission`'s: it must
    not have ended meanwhile). Each look is its own transaction: PostgreSQL keeps what a
    transaction first saw of pg_stat_activity until it ends."""
    waiting = text(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE wait_event_type = 'Lock' AND datname = current_database()"
    )
    deadline = time.monotonic() + 10
    async with engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        while (await conn.execute(waiting)).scalar_one() == 0:
            assert time.monotonic() < deadline, "the admission never waited"
            assert not admission.done(), "admitted while what it waits for was held"
            await asyncio.sleep(0.05)  # polling pg_stat_activity for the wait


async def _admit_uncommitted(engine: AsyncEngine, tenant: str, name: str) -> AsyncConnection:
    """Admit a run of `tenant` in a transaction left open (the caller commits it): what it
    holds, it holds until then."""
    conn = await engine.connect()
    await conn.begin()
    params = admission.admit_params(
        event=chat(name, tenant=tenant, conversation=name),
        request_hash=b"h" * 32,
        run_id=new_id("run"),
        session_id=new_id("ses"),
        message_id=new_id("msg"),
        max_attempts=3,
        traceparent=None,
    )
    assert await admission.admit_new(conn, params) is not None
    return conn


async def _tags(engine: AsyncEngine, tenant: str) -> list[float]:
    async with engine.connect() as conn:
        found = await conn.execute(
            select(runs.c.fair_key).where(runs.c.tenant_id == tenant).order_by(runs.c.fair_key)
        )
        return list(found.scalars())


async def test_a_tenants_admission_does_not_wait_for_another_of_its_admissions_to_commit(
    engine: AsyncEngine,
) -> None:
    await _weigh(engine, {"tw": 1})
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    await _queue(admitter, "tw", 1)
    held = await _admit_uncommitted(engine, "tw", "tw-held")
    try:
        # Admitted and committed while the tenant's other admission is still open.
        await asyncio.wait_for(admitter.admit(chat("tw-2", tenant="tw", conversation="tw-2")), 10)
    finally:
        await held.commit()
        await held.close()
    # The tenant's tags go on one run at a time, whichever admission commits first.
    assert await _tags(engine, "tw") == [0, 1, 2]


async def test_with_every_stripe_held_an_admission_waits_for_the_next_tag(
    engine: AsyncEngine,
) -> None:
    await _weigh(engine, {"ts": 1})
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    await _queue(admitter, "ts", 1)
    # As many admissions of the tenant open at once as it has stripes: tags 1 to STRIPES.
    held = [await _admit_uncommitted(engine, "ts", f"ts-held-{i}") for i in range(STRIPES)]
    late = asyncio.create_task(admitter.admit(chat("ts-late", tenant="ts", conversation="ts-late")))
    try:
        await _until_waiting(engine, late)
        # It waits for the stripe with the least next tag (the first held), and takes that
        # stripe's next one once it commits.
        await held[0].commit()
        await asyncio.wait_for(late, 10)
    finally:
        for conn in held:
            if conn.in_transaction():
                await conn.commit()
            await conn.close()
    assert await _tags(engine, "ts") == list(range(STRIPES + 2))


async def test_a_tenants_first_admissions_at_once_take_their_own_tags(
    engine: AsyncEngine,
) -> None:
    """Two first runs of a tenant admitted at once: the later waits for the earlier's stripes
    and takes the next tag from them, instead of both starting at the virtual time (a burst of
    a new tenant's first runs would otherwise all share one tag, and go ahead of everyone)."""
    await _weigh(engine, {"tf": 1})
    held = await _admit_uncommitted(engine, "tf", "tf-first")
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    second = asyncio.create_task(admitter.admit(chat("tf-2", tenant="tf", conversation="tf-2")))
    try:
        await _until_waiting(engine, second)
        await held.commit()
        await asyncio.wait_for(second, 10)
    finally:
        if held.in_transaction():
            await held.commit()
        await held.close()
    assert await _tags(engine, "tf") == [0, 1]


async def test_a_tenants_admissions_at_once_take_tags_that_follow_on(engine: AsyncEngine) -> None:
    """Eight admissions of one tenant at a time, 400 in all: each takes the least free tag of
    its tenant's. A statement picks its stripe by the tails it read when it began, and may lock
    it only after another admission took that stripe's tag and committed: it must then not
    take the stripe's next tag (16 runs on) while a stripe with the next tag of all is free."""
    await _weigh(engine, {"tq": 1})
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())

    async def admit(first: int) -> None:
        for n in range(first, 400, 8):
            if n:
                await admitter.admit(chat(f"tq-{n}", tenant="tq", conversation=f"tq-{n}"))

    async def admit_first() -> None:  # the tenant's stripes made
        await admitter.admit(chat("tq-0", tenant="tq", conversation="tq-0"))

    await admit_first()
    with counting(engine) as sent:
        await asyncio.gather(*(admit(i) for i in range(8)))
    tags = await _tags(engine, "tq")
    gaps = [(before, after - before) for before, after in itertools.pairwise(tags)]
    # A tag a statement took and handed back to no run leaves a gap of 2 at most.
    assert max(gap for _, gap in gaps) <= 2, [(tag, gap) for tag, gap in gaps if gap > 2]
    # Each took its tag in its own statement: none had to be retagged (a stripe that moved
    # after its snapshot is passed over, not taken and handed back), once the stripes exist.
    retags = [s for s in sent.statements if "UPDATE runs SET fair_key" in s]
    assert retags == [], f"{len(retags)} of 399 admissions retagged"
