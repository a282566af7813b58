"""The topology floor's intake with admission's records, against the real PostgreSQL: each call
sends admission's own statement bare and admits a new run with every record admission keeps."""

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
        admitted = [(await conn.fetchrow(*_call(arguments)))["run_id"] for _ in range(2)]
        runs = await conn.fetch(
            "SELECT r.status, r.tenant_id, m.message_id IS NOT NULL AS message, "
            "s.active_run_id = r.run_id AS head, c.run_id = r.run_id AS claimed, "
            "(SELECT array_agg(type) FROM run_events e WHERE e.run_id = r.run_id) AS events "
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


def _call(arguments: topology_floor.Arguments) -> list[object]:
    sql, args = arguments()
    return [sql, *args]
