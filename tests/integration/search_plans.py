"""A database a scan would cost (thousands of finished runs and resolved interactions, a few
live), and the plan PostgreSQL keeps for a statement once it uses its generic plan: what the
searches' tests read their plans from."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tether import apikeys

FINISHED = 3000  # finished runs and resolved interactions: a table a scan would cost


async def finished_history(engine: AsyncEngine, *, tenants: int = 1) -> None:
    """FINISHED completed runs, each with its session, message and a delivered interaction;
    a handful of runs in each live state; statistics gathered, as autovacuum would. Spread over
    `tenants` tenants (t1, t2, ...) in turn."""
    async with engine.begin() as conn:
        await apikeys.ensure_tenant(conn, "t1")
        await conn.execute(
            text(
                "INSERT INTO tenants (tenant_id, name) SELECT 't' || n, 't' || n "
                "FROM generate_series(2, :tenants) n"
            ),
            {"tenants": tenants},
        )
        await conn.execute(
            text(
                "INSERT INTO sessions (session_id, tenant_id, channel, conversation_id, "
                "actor_scope) SELECT 'ses-' || n, 't' || n % :tenants + 1, 'chat', 'c-' || n, "
                "'principal:alice' FROM generate_series(1, :n) n"
            ),
            {"n": FINISHED + 12, "tenants": tenants},
        )
        await conn.execute(
            text(
                "INSERT INTO messages (message_id, tenant_id, session_id, source, event_id, "
                "actor_type, actor_id, text) SELECT 'msg-' || n, 't' || n % :tenants + 1, "
                "'ses-' || n, 'chat', 'e-' || n, 'user', 'alice', 'hello' "
                "FROM generate_series(1, :n) n"
            ),
            {"n": FINISHED + 12, "tenants": tenants},
        )
        # The last twelve live: three in each state a search looks for.
        await conn.execute(
            text(
                "INSERT INTO runs (run_id, tenant_id, session_id, message_id, conversation_id, "
                "channel, input_text, status, max_attempts, root_run_id, visibility, "
                "session_head, started_at, finished_at, lease_expires_at, next_attempt_at) "
                "SELECT 'run-' || n, 't' || n % :tenants + 1, 'ses-' || n, 'msg-' || n, "
                "'c-' || n, 'chat', 'hello', s.status, 3, 'run-' || n, 'private', true, "
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
            {"n": FINISHED + 12, "finished": FINISHED, "tenants": tenants},
        )
        await conn.execute(
            text(
                "INSERT INTO interactions (interaction_id, tenant_id, run_id, session_id, kind, "
                "status, tool_call_id, expires_at, resolved_at, delivered_at, bound_at) "
                "SELECT 'int-' || n, 't' || n % :tenants + 1, 'run-' || n, 'ses-' || n, "
                "'question', "
                "CASE WHEN n <= :finished THEN 'answered' ELSE 'pending' END, 'call-' || n, "
                "now() + interval '1 h', "
                "CASE WHEN n <= :finished THEN now() END, "
                "CASE WHEN n <= :finished THEN now() END, "
                "CASE WHEN n % 2 = 0 THEN now() END "
                "FROM generate_series(1, :n) n"
            ),
            {"n": FINISHED + 12, "finished": FINISHED, "tenants": tenants},
        )
    async with engine.begin() as conn:
        for table in ("runs", "run_keys", "interactions", "messages", "sessions"):
            await conn.execute(text(f"ANALYZE {table}"))


async def generic_plan(
    engine: AsyncEngine, sql: str, params: int, planner: Mapping[str, str] | None = None
) -> str:
    """The plan PostgreSQL runs `sql` with once it keeps the prepared statement's generic plan
    (forced here, as it may be chosen there after five runs), without running it; planned with
    `planner`'s settings too, when given (a pool's, `create_engine(planner=...)`)."""
    settings = {"plan_cache_mode": "force_generic_plan", **(planner or {})}
    async with engine.connect() as conn:
        driver = (await conn.get_raw_connection()).driver_connection
        assert driver is not None
        for name, value in settings.items():
            await driver.execute(f"SET {name} = {value}")
        try:
            await driver.execute(f"PREPARE search AS {sql}")
            nulls = ", ".join(["NULL"] * params)
            rows = await driver.fetch(f"EXPLAIN EXECUTE search{f'({nulls})' if params else ''}")
            await driver.execute("DEALLOCATE search")
        finally:
            for name in settings:
                await driver.execute(f"RESET {name}")
        return "\n".join(row[0] for row in rows)


async def statements_sent(
    engine: AsyncEngine, search: Callable[[AsyncConnection], Awaitable[Any]]
) -> list[tuple[str, Any]]:
    """The statements `search` sends through `engine`, each with its parameters, as they go
    to PostgreSQL (on a connection of its own, whose transaction is undone)."""
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
    return sent
