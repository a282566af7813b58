"""The topology floor with Tether's records, against the real PostgreSQL: the intake sends
admission's own statement bare and admits a new run with every record admission keeps; the
dispatcher's claim leases it and its completion ends it with every record a one-turn run
keeps."""

from __future__ import annotations

import asyncpg
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from bench import topology_floor
from tests.integration.test_admission import _tenant

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_each_call_admits_a_new_run_with_its_records(
    engine: AsyncEngine, db_url: str
) -> None:
    await _tenant(engine, "bench")
    arguments = topology_floor._admitted()
    conn = await asyncpg.connect(db_url)
    try:
        admitted = [(await conn.fetchrow(*arguments()))["run_id"] for _ in range(2)]
        runs = await conn.fetch(
            "SELECT r.status, r.tenant_id, m.message_id IS NOT NULL AS message, "
            "s.active_run_id = r.run_id AS head, c.run_id = r.run_id AS claimed, "
            "(SELECT array_agg(type) FROM run_event_log e WHERE e.run_id = r.run_id) AS events "
            "FROM runs r JOIN messages m ON m.message_id = r.message_id "
            "JOIN sessions s ON s.session_id = r.session_id "
            "JOIN event_claims c ON c.run_id = r.run_id WHERE r.run_id = ANY($1)",
            admitted,
        )
    finally:
        await conn.close()

    assert len(set(admitted)) == 2
    assert [dict(r) for r in runs] == [
        {
            "status": "queued",
            "tenant_id": "bench",
            "message": True,
            "head": True,
            "claimed": True,
            "events": ["run.queued"],
        }
    ] * 2


async def test_the_claim_leases_what_was_admitted_and_the_completion_ends_it(
    engine: AsyncEngine, db_url: str
) -> None:
    await _tenant(engine, "bench")
    arguments = topology_floor._admitted()
    conn = await asyncpg.connect(db_url)
    pool = await asyncpg.create_pool(db_url, min_size=1, max_size=1)
    try:
        kept = await topology_floor._Kept.of(pool)
        admitted = sorted([(await conn.fetchrow(*arguments()))["run_id"] for _ in range(2)])
        leased = kept.leased(await conn.fetch(*kept.claim(8)))
        assert await conn.fetch(*kept.claim(8)) == []  # both are leased already
        for run_id in leased:
            assert await conn.fetchrow(*kept.complete(run_id)) is not None
        ended = await conn.fetch(
            # Answered: whole, or (format 5) as its text part alone.
            "SELECT r.status, coalesce(r.result_text, (SELECT p.payload ->> 'text' "
            "FROM run_parts p WHERE p.run_id = r.run_id AND p.kind = 'text' AND r.format = 5)) "
            "<> '' AS answered, "
            "(SELECT array_agg(type ORDER BY seq) FROM run_event_log e WHERE e.run_id = r.run_id) "
            "AS events, (SELECT count(*) FROM run_parts p WHERE p.run_id = r.run_id) AS parts, "
            "(SELECT count(*) FROM usage_turns u WHERE u.run_id = r.run_id) AS turns, "
            "(SELECT outcome FROM attempts a WHERE a.run_id = r.run_id) AS attempt, "
            "(SELECT count(*) FROM audit_log l WHERE l.run_id = r.run_id) AS audited "
            "FROM runs r WHERE r.run_id = ANY($1) ORDER BY r.run_id",
            admitted,
        )
    finally:
        await pool.close()
        await conn.close()

    assert sorted(leased) == admitted
    assert [dict(r) for r in ended] == [
        {
            "status": "completed",
            "answered": True,
            "events": ["run.queued", "run.started", "part.added", "usage.updated", "run.completed"],
            "parts": 1,
            "turns": 1,
            "attempt": "completed",
            "audited": 0,  # an attempt's end is its own record (attempts.detail)
        }
    ] * 2
