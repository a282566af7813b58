"""Admissions written together against the real PostgreSQL: those that arrive while admission's
writer is busy go in its next round trip, one transaction with no BEGIN or COMMIT; a duplicate
among them attaches to the run its twin created; and a caller that goes away while its group
is being written leaves nothing behind, while the rest of its group is written without it.

Each race is set up by synchronisation: an admission waits on a claim another transaction holds
uncommitted (seen in pg_stat_activity), the others are seen in the committer's line, then the
holder commits."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.admission import repository as admission
from services.admission.domain import FreshnessPolicy
from services.admission.service import Admitter, Disposition
from tests.integration.test_admission import _tenant, chat
from tests.integration.test_fair_leases import _admit_uncommitted, _until_waiting
from tests.integration.test_group_commit import pipelined, round_trips
from tether.db.schema import runs
from tether.errors import AlreadyExists
from tether.testing.eventually import eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")


def _one_writer(engine: AsyncEngine) -> Admitter:
    """Admission through a committer with one writer: while it is busy, the others wait in line
    for its next round trip."""
    return Admitter(engine, max_attempts=3, freshness=FreshnessPolicy(), writers=1)


async def _in_line(admitter: Admitter, count: int) -> None:
    async def lined() -> bool | None:
        return True if admitter.committer.waiting == count else None

    await eventually(lined, what=f"{count} admissions in line")


async def _xmins(engine: AsyncEngine, run_ids: list[str]) -> set[str]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            select(text("runs.xmin::text AS xmin")).where(runs.c.run_id.in_(run_ids))
        )
        return {r.xmin for r in rows}


async def _commit(conn: AsyncConnection) -> None:
    await conn.commit()
    await conn.close()


async def _behind_a_held_claim(
    engine: AsyncEngine, admitter: Admitter, tenant: str, calls: list[Any]
) -> tuple[AsyncConnection, asyncio.Task[Any], list[asyncio.Task[Any]]]:
    """The writer held on a call naming a claim another transaction holds uncommitted (with
    other content: once that commits, the call is refused as a conflict), and `calls` lined up
    behind it."""
    holder = await _admit_uncommitted(engine, tenant, f"{tenant}-held")
    first = asyncio.create_task(
        admitter.admit(chat(f"{tenant}-held", tenant=tenant, conversation=f"{tenant}-held"))
    )
    await _until_waiting(engine, first)
    lined = [asyncio.create_task(call) for call in calls]
    await _in_line(admitter, len(calls))
    return holder, first, lined


async def test_admissions_that_arrive_together_are_one_round_trip_and_one_transaction(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "ga")
    admitter = _one_writer(engine)
    events = [chat(f"ga-{i}", tenant="ga", conversation=f"ga-{i}") for i in range(4)]
    async with round_trips(engine) as sent:
        holder, first, lined = await _behind_a_held_claim(
            engine, admitter, "ga", [admitter.admit(e) for e in events]
        )
        await _commit(holder)
        with pytest.raises(AlreadyExists):
            await first  # the held claim's content is not this call's
        admitted = await asyncio.gather(*lined)
    assert [a.disposition for a in admitted] == [Disposition.CREATED] * len(events)
    run_ids = [a.run.run_id for a in admitted]
    assert len(await _xmins(engine, run_ids)) == 1, "one transaction wrote them all"
    assert pipelined(engine, sent, admission.ADMIT_NEW) == len(events), "in one round trip"


async def test_a_duplicate_written_together_with_its_twin_attaches_to_its_run(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "gd")
    admitter = _one_writer(engine)
    twin = chat("gd-1", tenant="gd", conversation="gd-1")
    holder, first, lined = await _behind_a_held_claim(
        engine,
        admitter,
        "gd",
        [admitter.admit(twin), admitter.admit(twin), admitter.admit(chat("gd-2", tenant="gd"))],
    )
    await _commit(holder)
    with pytest.raises(AlreadyExists):
        await first
    one, two, other = await asyncio.gather(*lined)
    assert sorted([one.disposition, two.disposition]) == [
        Disposition.ATTACHED,
        Disposition.CREATED,
    ]
    assert one.run.run_id == two.run.run_id
    assert other.disposition is Disposition.CREATED
    async with engine.connect() as conn:
        count = await conn.execute(
            select(text("count(*)")).select_from(runs).where(runs.c.tenant_id == "gd")
        )
        assert count.scalar_one() == 3, "the held one, the twins' one, the other"


async def test_a_caller_gone_while_its_group_is_written_leaves_nothing_and_the_rest_land(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "gc")
    admitter = _one_writer(engine)
    # The tenant's stripes made, so that the two held admissions below do not wait for each
    # other (a tenant's first runs at once do).
    await admitter.admit(chat("gc-first", tenant="gc", conversation="gc-first"))
    # The group (a, b, c) waits on b's claim, which a second transaction holds uncommitted.
    second = await _admit_uncommitted(engine, "gc", "gc-b")
    a, b, c = (chat(f"gc-{n}", tenant="gc", conversation=f"gc-{n}") for n in "abc")
    holder, first, (to_a, to_b, to_c) = await _behind_a_held_claim(
        engine, admitter, "gc", [admitter.admit(a), admitter.admit(b), admitter.admit(c)]
    )
    await _commit(holder)
    with pytest.raises(AlreadyExists):
        await first
    await _until_waiting(engine, to_b)  # the group, on b's held claim
    to_c.cancel()
    # The group is stopped and written again without c: it waits on b's claim once more.
    await eventually(lambda: _stopped(to_c), what="c's call to end")
    await _until_waiting(engine, to_b)
    await _commit(second)
    assert (await to_a).disposition is Disposition.CREATED
    with pytest.raises(AlreadyExists):
        await to_b  # its claim was the second's, with other content
    # Nothing of c was written: sent again, it is admitted afresh.
    assert (await admitter.admit(c)).disposition is Disposition.CREATED


async def _stopped(task: asyncio.Task[Any]) -> bool | None:
    return True if task.cancelled() else None


async def test_a_burst_of_one_tenants_admissions_in_groups_never_deadlocks(
    engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    # Four times as many admissions of one tenant at once as it has stripes, written in
    # groups: a group that holds one of the tenant's stripes takes its next runs' tags from
    # its own when the others are held, and one that holds none waits holding nothing of the
    # tenant (groups go in tenant order), so no two groups wait for each other. A group that
    # failed (a deadlock PostgreSQL broke) would have been written again alone, and logged.
    await _tenant(engine, "gb")
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    await admitter.admit(chat("gb-first", tenant="gb", conversation="gb-first"))
    caplog.set_level(logging.INFO, logger="tether.db.committer")
    calls = []
    async with round_trips(engine) as sent:
        for wave in range(4):
            # Each wave is taken whole by the next free writer, while the waves before it are
            # still being written.
            calls += [
                asyncio.create_task(
                    admitter.admit(chat(f"gb-{i}", tenant="gb", conversation=f"gb-{i}"))
                )
                for i in range(wave * 16, wave * 16 + 16)
            ]
            await _taken(admitter)
        admitted = await asyncio.gather(*calls)
    assert {a.disposition for a in admitted} == {Disposition.CREATED}
    assert not [r.message for r in caplog.records if "writing each alone" in r.message]
    groups = [len(args) for _, sql, args in sent if isinstance(args, list)]
    assert groups == [16] * 4, groups


async def _taken(admitter: Admitter) -> None:
    await asyncio.sleep(0)  # one turn: the wave's calls join the line (not a wait for time)
    assert admitter.committer.waiting == 16, "the wave in line"

    async def empty() -> bool | None:
        return True if admitter.committer.waiting == 0 else None

    await eventually(empty, what="the line taken by a writer")
