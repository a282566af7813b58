"""The hot-path bench's append-only WAL floor against the real PostgreSQL: it writes again
exactly the rows finished runs left, once each, into copies of their tables with every index,
and touches nothing of the stack's."""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

import asyncpg
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from bench import wal_floor
from services.admission.domain import FreshnessPolicy
from services.admission.service import Admitter
from tests.integration.test_admission import _tenant, chat
from tests.integration.test_completion_statement import _answer, _claim, _execution

pytestmark = pytest.mark.asyncio(loop_scope="session")

RUNS = 3


async def _finished_runs(engine: AsyncEngine) -> list[str]:
    await _tenant(engine, "t1")
    execution = _execution(engine)
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    for i in range(RUNS):
        await admitter.admit(chat(f"e{i}", conversation=f"c{i}"))
    claimed = await _claim(execution, RUNS)
    for c in claimed:
        await execution.attempts.complete(c.run.run_id, c.run.lease_epoch, _answer(f"answer {c}"))
    return sorted(c.run.run_id for c in claimed)


async def _contents(conn: asyncpg.Connection, table: str, where: str, run_ids: list[str]) -> list:
    rows = await conn.fetch(f"SELECT * FROM {table} WHERE {where}", run_ids)
    return sorted(tuple(r.values()) for r in rows)


async def test_the_floor_writes_each_row_of_the_runs_once_and_leaves_the_stacks_alone(
    engine: AsyncEngine, db_url: str, pg_server_url: str
) -> None:
    run_ids = await _finished_runs(engine)
    database = unquote(urlsplit(db_url).path.lstrip("/"))
    admin = await asyncpg.connect(pg_server_url)
    conn = await asyncpg.connect(db_url)
    try:
        before = {
            t: await _contents(conn, t, where, run_ids) for t, where in wal_floor._SOURCES.items()
        }
        floor = await wal_floor.append_only(admin, db_url, database, run_ids)

        for table, where in wal_floor._SOURCES.items():
            kept = await _contents(conn, table, where, run_ids)
            assert kept == before[table], table  # the stack's rows are as they were
            copied = await _contents(conn, f"floor_{table}", "true OR $1::text[] IS NULL", run_ids)
            assert copied == kept, table  # each row once, as the stack left it
            # Written once and never updated, locked or deleted: no row version has an xmax.
            touched = await conn.fetchval(f"SELECT count(*) FROM floor_{table} WHERE xmax <> 0")
            assert touched == 0, table
        indexes = await conn.fetch(
            "SELECT tablename, count(*) AS n FROM pg_indexes WHERE tablename = ANY($1) "
            "GROUP BY tablename",
            [t for s in wal_floor._SOURCES for t in (s, f"floor_{s}")],
        )
        counts = {r["tablename"]: r["n"] for r in indexes}
        for table in wal_floor._SOURCES:
            assert counts[f"floor_{table}"] == counts[table], table  # every index, copied
    finally:
        await conn.close()
        await admin.close()

    assert floor.runs == RUNS
    assert floor.rows_per_run == {t: len(rows) / RUNS for t, rows in before.items()}
    assert floor.rows_per_run["runs"] == 1
    assert floor.bytes > 0


async def test_a_runs_admission_rows_come_first_and_the_rest_after(
    engine: AsyncEngine, db_url: str
) -> None:
    run_ids = await _finished_runs(engine)
    conn = await asyncpg.connect(db_url)
    try:
        rows = {
            t: await conn.fetch(f"SELECT * FROM {t} WHERE {w}", run_ids)
            for t, w in wal_floor._SOURCES.items()
        }
    finally:
        await conn.close()

    split = wal_floor._by_run(rows)

    assert sorted(split) == run_ids
    assert sum(len(a) + len(e) for a, e in split.values()) == sum(map(len, rows.values()))
    for admission, execution in split.values():
        assert [t for t, _ in admission] == [
            "event_claims",
            "sessions",
            "messages",
            "runs",
            "run_keys",
        ]  # its run.queued is read from the run's row (0048)
        tables = [t for t, _ in execution]
        assert "runs" not in tables and "run_events" in tables
        assert {"attempts", "run_parts", "usage_turns"} <= set(tables)
        assert "audit_log" not in tables, "an attempt's end is its own record"
