"""Searches by state read only the rows in that state, however many runs and interactions have
finished, in the plan a prepared statement runs with.

asyncpg prepares every statement, and after five runs PostgreSQL may keep a prepared
statement's generic plan, which is made without the parameters' values. A search whose state
is one of those parameters (`status = $1`) cannot use the partial index of that state: its
generic plan reads the whole table. The claim did, once per claim, against every run ever
admitted. Each search below is run for real on a database holding thousands of finished runs
and resolved interactions, its SQL caught as sent, and its generic plan read back."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.interactions import repository as interactions_repo
from services.orchestrator.repositories import leases, queue, transitions
from tether import apikeys

pytestmark = pytest.mark.asyncio(loop_scope="session")

FINISHED = 3000  # finished runs and resolved interactions: a table a scan would cost

Search = Callable[[AsyncConnection], Awaitable[Any]]

# (what it is, the search run for real, the table it searches, the partial index it must use)
SEARCHES: list[tuple[str, Search, str, str]] = [
    (
        "the claim",
        lambda conn: leases.claim(
            conn, leases.claim_params(worker_id="w-1", limit=8, ttl_s=30, routes=[], stored={})
        ),
        "runs",
        "ix_runs_fair",
    ),
    (
        "claimable runs counted",
        lambda conn: leases.count_claimable(conn, 8),
        "runs",
        "ix_runs_fair",
    ),
    (
        "the reaper's expired leases",
        lambda conn: leases.expired_leases(conn, 8),
        "runs",
        "ix_runs_running",
    ),
    ("due retries", lambda conn: leases.due_retries(conn, 8), "runs", "ix_runs_retry_due"),
    ("the queue's gauges", queue.queue_stats, "runs", "ix_runs_session_queued"),
    ("the next lease expiry", queue.next_expiry_in, "runs", "ix_runs_running"),
    ("the next retry", queue.next_retry_in, "runs", "ix_runs_retry_due"),
    (
        "expired interactions",
        lambda conn: interactions_repo.expired_pending(conn, 8),
        "interactions",
        "ix_interactions_open_expiry",
    ),
    (
        "unconfirmed interactions",
        lambda conn: interactions_repo.unconfirmed_pending(conn, 60, 8),
        "interactions",
        "ix_interactions_unconfirmed",
    ),
    (
        "undelivered resolutions",
        lambda conn: interactions_repo.undelivered(conn, 8),
        "interactions",
        "ix_interactions_undelivered",
    ),
    (
        "the next interaction expiry",
        interactions_repo.next_expiry_in,
        "interactions",
        "ix_interactions_open_expiry",
    ),
    (
        "the next binding check",
        lambda conn: interactions_repo.next_binding_check_in(conn, 60),
        "interactions",
        "ix_interactions_unconfirmed",
    ),
    (
        "the next redelivery",
        interactions_repo.next_redelivery_in,
        "interactions",
        "ix_interactions_undelivered",
    ),
]


async def _finished_history(engine: AsyncEngine) -> None:
    """FINISHED completed runs, each with its session, message and a delivered interaction;
    a handful of runs in each live state; statistics gathered, as autovacuum would."""
    async with engine.begin() as conn:
        await apikeys.ensure_tenant(conn, "t1")
        await conn.execute(
            text(
                "INSERT INTO sessions (session_id, tenant_id, channel, conversation_id, "
                "actor_scope) SELECT 'ses-' || n, 't1', 'chat', 'c-' || n, 'principal:alice' "
                "FROM generate_series(1, :n) n"
            ),
            {"n": FINISHED + 12},
        )
        await conn.execute(
            text(
                "INSERT INTO messages (message_id, tenant_id, session_id, source, event_id, "
                "actor_type, actor_id, text) SELECT 'msg-' || n, 't1', 'ses-' || n, 'chat', "
                "'e-' || n, 'user', 'alice', 'hello' FROM generate_series(1, :n) n"
            ),
            {"n": FINISHED + 12},
        )
        # The last twelve live: three in each state a search looks for.
        await conn.execute(
            text(
                "INSERT INTO runs (run_id, tenant_id, session_id, message_id, conversation_id, "
                "channel, input_text, status, max_attempts, root_run_id, visibility, "
                "session_head, started_at, finished_at, lease_expires_at, next_attempt_at) "
                "SELECT 'run-' || n, 't1', 'ses-' || n, 'msg-' || n, 'c-' || n, 'chat', "
                "'hello', s.status, 3, 'run-' || n, 'private', true, "
                "CASE WHEN s.status = 'queued' THEN NULL ELSE now() END, "
                "CASE WHEN s.status = 'completed' THEN now() END, "
                "CASE WHEN s.status = 'running' THEN now() + interval '30 s' END, "
                "CASE WHEN s.status = 'retry-pending' THEN now() + interval '1 min' END "
                "FROM generate_series(1, :n) n, LATERAL (SELECT CASE "
                "WHEN n <= :finished THEN 'completed' "
                "ELSE (ARRAY['queued', 'running', 'retry-pending', 'waiting-for-question'])"
                "[n % 4 + 1] "
                "END AS status) s"
            ),
            {"n": FINISHED + 12, "finished": FINISHED},
        )
        await conn.execute(
            text(
                "INSERT INTO interactions (interaction_id, tenant_id, run_id, session_id, kind, "
                "status, tool_call_id, expires_at, resolved_at, delivered_at, bound_at) "
                "SELECT 'int-' || n, 't1', 'run-' || n, 'ses-' || n, 'question', "
                "CASE WHEN n <= :finished THEN 'answered' ELSE 'pending' END, 'call-' || n, "
                "now() + interval '1 h', "
                "CASE WHEN n <= :finished THEN now() END, "
                "CASE WHEN n <= :finished THEN now() END, "
                "CASE WHEN n % 2 = 0 THEN now() END "
                "FROM generate_series(1, :n) n"
            ),
            {"n": FINISHED + 12, "finished": FINISHED},
        )
    async with engine.begin() as conn:
        for table in ("runs", "interactions", "messages", "sessions"):
            await conn.execute(text(f"ANALYZE {table}"))


async def _generic_plan(engine: AsyncEngine, sql: str, params: int) -> str:
    """The plan PostgreSQL runs `sql` with once it keeps the prepared statement's generic plan
    (forced here, as it may be chosen there after five runs), without running it."""
    async with engine.connect() as conn:
        driver = (await conn.get_raw_connection()).driver_connection
        assert driver is not None
        await driver.execute("SET plan_cache_mode = force_generic_plan")
        try:
            await driver.execute(f"PREPARE search AS {sql}")
            nulls = ", ".join(["NULL"] * params)
            rows = await driver.fetch(f"EXPLAIN EXECUTE search{f'({nulls})' if params else ''}")
            await driver.execute("DEALLOCATE search")
        finally:
            await driver.execute("RESET plan_cache_mode")
        return "\n".join(row[0] for row in rows)


@pytest.mark.parametrize(
    ("what", "search", "table", "index"), SEARCHES, ids=[s[0] for s in SEARCHES]
)
async def test_a_search_by_state_uses_that_state_s_partial_index(
    engine: AsyncEngine, what: str, search: Search, table: str, index: str
) -> None:
    await _finished_history(engine)
    sent: list[tuple[str, Any]] = []

    def caught(conn: Any, cursor: Any, statement: str, parameters: Any, *args: Any) -> None:
        sent.append((statement, parameters))

    event.listen(engine.sync_engine, "before_cursor_execute", caught)
    try:
        async with engine.connect() as conn:
            await search(conn)
            await conn.rollback()
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", caught)
    searches = [(sql, params) for sql, params in sent if table in sql]
    assert len(searches) == 1, f"{what}: one statement on {table}, sent {len(searches)}"
    sql, params = searches[0]
    plan = await _generic_plan(engine, sql, len(params or ()))
    assert f"Seq Scan on {table}" not in plan, f"{what} reads all of {table}:\n{plan}"
    assert index in plan, f"{what} does not search {index}:\n{plan}"


async def test_a_session_s_next_queued_run_is_found_by_its_session(engine: AsyncEngine) -> None:
    """The hand-over's search (transitions._NEXT_QUEUED) is keyed by the session: whatever the
    plan, it reads that session's runs, not the table."""
    await _finished_history(engine)
    sql = str(transitions._NEXT_QUEUED.element.compile(dialect=engine.dialect))
    plan = await _generic_plan(engine, sql, sql.count("$"))
    assert "Seq Scan on runs" not in plan, plan
