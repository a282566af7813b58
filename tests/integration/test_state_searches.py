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
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.interactions import repository as interactions_repo
from services.orchestrator.repositories import leases, queue, transitions
from tests.integration.search_plans import finished_history, generic_plan, statements_sent

pytestmark = pytest.mark.asyncio(loop_scope="session")

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


@pytest.mark.parametrize(
    ("what", "search", "table", "index"), SEARCHES, ids=[s[0] for s in SEARCHES]
)
async def test_a_search_by_state_uses_that_state_s_partial_index(
    engine: AsyncEngine, what: str, search: Search, table: str, index: str
) -> None:
    await finished_history(engine)
    sent = await statements_sent(engine, search)
    searches = [(sql, params) for sql, params in sent if table in sql]
    assert len(searches) == 1, f"{what}: one statement on {table}, sent {len(searches)}"
    sql, params = searches[0]
    plan = await generic_plan(engine, sql, len(params or ()))
    assert f"Seq Scan on {table}" not in plan, f"{what} reads all of {table}:\n{plan}"
    assert "Seq Scan on run_keys" not in plan, f"{what} reads all of run_keys:\n{plan}"
    assert index in plan, f"{what} does not search {index}:\n{plan}"


async def test_a_session_s_next_queued_run_is_found_by_its_session(engine: AsyncEngine) -> None:
    """The hand-over's search (transitions._NEXT_QUEUED) is keyed by the session: whatever the
    plan, it reads that session's runs, not the table."""
    await finished_history(engine)
    # The state written in (in_state) rendered as sent; the keys stay parameters.
    keyed = transitions._NEXT_QUEUED.element.params(h_session_id=None, h_run_id=None)
    compiled = keyed.compile(dialect=engine.dialect, compile_kwargs={"render_postcompile": True})
    sql = str(compiled)
    plan = await generic_plan(engine, sql, sql.count("$"))
    assert "Seq Scan on runs" not in plan, plan
