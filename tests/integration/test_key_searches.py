"""Reads of runs by their lookup keys (tenant, owner, session, message) find them in `run_keys`:
`runs` has no index by those keys since 0047 dropped its four (issue 34: each of the run row's
two non-HOT updates adds an entry to every index of `runs`, whose keys never change).

Each read is run for real on a database holding thousands of runs, its SQL caught as sent, and
its generic plan read back: it must search `run_keys` by the index of its key and read `runs` by
id only, never scan either. And `run_keys` holds exactly the keys of the runs there are: a
trigger adds them with every insert of runs and removes them with every delete, whichever
release's code writes."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.admission import repository as admission_repo
from services.orchestrator.repositories import agents, history, retention, webhook_dispatch
from services.orchestrator.repositories import runs as runs_repo
from services.orchestrator.repositories.runs import search_runs
from tests.integration.search_plans import finished_history, generic_plan, statements_sent
from tether.visibility import Viewer

pytestmark = pytest.mark.asyncio(loop_scope="session")

BY_OWNER = "ix_run_keys_tenant_id_owner_principal_id_created_at_run_id"
# A tenant's keys: its primary key's, or the owners' index (which the tenant leads too).
BY_TENANT = ("pk_run_keys", BY_OWNER)
BY_SESSION = "ix_run_keys_session_id_created_at"
BY_MESSAGE = "ix_run_keys_message_id"
LONG_AGO = datetime.now(UTC) - timedelta(days=1)
# The runs spread over as many tenants: a tenant's are a few of the table's, as in production.
TENANTS = 1000

Search = Callable[[AsyncConnection], Awaitable[Any]]


def _listed(viewer: Viewer) -> Search:
    return lambda conn: search_runs(
        conn, viewer, statuses=[], conversation_id="", page_size=20, page_token=""
    )


def _history(conn: AsyncConnection) -> Awaitable[Any]:
    wanted = history.Wanted("run-1", "ses-1", datetime.now(UTC), history=True, own=False)
    return history.attempt_inputs(conn, [wanted], limit_runs=10)


# (what it is, the read run for real, the index of run_keys it must search, or the indexes)
SEARCHES: list[tuple[str, Search, str | tuple[str, ...]]] = [
    ("ListRuns of a runs:all key", _listed(Viewer("t1", "alice", all_runs=True)), BY_TENANT),
    ("ListRuns of a principal", _listed(Viewer("t1", "alice")), BY_OWNER),
    ("a session's history at lease", _history, BY_SESSION),
    ("the runs pinned to an agent", lambda c: agents.pinned_runs(c, "t1", "helper", 10), BY_TENANT),
    ("a tenant's runs to delete", lambda c: retention.delete_tenant_runs(c, "t1", 10), BY_TENANT),
    ("whether a tenant has runs", lambda c: retention.tenant_has_runs(c, "t1"), BY_TENANT),
    (
        "runs past retention, unless a live conversation reads them",
        lambda c: retention.remove_expired_runs(c, ["run-1", "run-2"], 0, 0),
        BY_SESSION,
    ),
    (
        "messages past retention, unless a run names them",
        lambda c: admission_repo.remove_unused_messages(c, ["msg-1", "msg-2"]),
        BY_MESSAGE,
    ),
]


async def _plan_scanning_neither(engine: AsyncEngine, sql: str, params: int) -> str:
    plan = await generic_plan(engine, sql, params)
    assert "Seq Scan on runs" not in plan, plan
    assert "Seq Scan on run_keys" not in plan, plan
    return plan


@pytest.mark.parametrize(("what", "search", "index"), SEARCHES, ids=[s[0] for s in SEARCHES])
async def test_a_read_by_key_searches_run_keys_and_reads_runs_by_id(
    engine: AsyncEngine, what: str, search: Search, index: str | tuple[str, ...]
) -> None:
    await finished_history(engine, tenants=TENANTS)
    sent = await statements_sent(engine, search)
    searches = [(sql, params) for sql, params in sent if "run_keys" in sql]
    assert len(searches) == 1, f"{what}: one statement on run_keys, sent {len(searches)}"
    sql, params = searches[0]
    plan = await _plan_scanning_neither(engine, sql, len(params or ()))
    indexes = (index,) if isinstance(index, str) else index
    assert any(name in plan for name in indexes), f"{what} does not search {index}:\n{plan}"


async def test_a_webhook_s_look_at_the_runs_waiting_searches_the_tenant_s_keys(
    engine: AsyncEngine,
) -> None:
    await finished_history(engine, tenants=TENANTS)
    statement = webhook_dispatch._RECORD_FINISHED_AND_WAITING
    sql = str(statement.compile(dialect=engine.dialect))
    plan = await _plan_scanning_neither(engine, sql, len(set(re.findall(r"\$\d+", sql))))
    assert any(name in plan for name in BY_TENANT), plan


async def _keys_and_runs(conn: AsyncConnection) -> tuple[list[Any], list[Any]]:
    columns = "tenant_id, created_at, run_id, owner_principal_id, session_id, message_id"
    keys = (await conn.execute(text(f"SELECT {columns} FROM run_keys ORDER BY run_id"))).all()
    rows = (await conn.execute(text(f"SELECT {columns} FROM runs ORDER BY run_id"))).all()
    return list(keys), list(rows)


async def test_run_keys_holds_the_keys_of_every_run_inserted_and_none_deleted(
    engine: AsyncEngine,
) -> None:
    """Inserted by one statement of many rows (as `finished_history` does) and of one row, and
    deleted by a tenant's deletion: the keys are the runs' own, row for row."""
    await finished_history(engine, tenants=TENANTS)
    async with engine.begin() as conn:
        keys, rows = await _keys_and_runs(conn)
        assert len(rows) > 3000
        assert keys == rows
        await conn.execute(
            text(
                "INSERT INTO runs (run_id, tenant_id, session_id, message_id, conversation_id, "
                "channel, input_text, status, max_attempts, root_run_id, visibility, "
                "owner_principal_id, created_at) VALUES ('run-late', 't1', 'ses-1', 'msg-1', "
                "'c-1', 'chat', 'again', 'queued', 3, 'run-late', 'private', 'bob', :at)"
            ),
            {"at": LONG_AGO},
        )
        keys, rows = await _keys_and_runs(conn)
        assert keys == rows
        assert ("t1", LONG_AGO, "run-late", "bob", "ses-1", "msg-1") in {tuple(k) for k in keys}
        before = len(rows)
        of_t1 = sum(1 for row in rows if row.tenant_id == "t1")
        assert of_t1 > 1
        assert await retention.delete_tenant_runs(conn, "t1", 100) == of_t1
        keys, rows = await _keys_and_runs(conn)
    assert keys == rows
    assert len(rows) == before - of_t1
    assert "t1" not in {row.tenant_id for row in rows}


async def test_list_runs_decides_who_sees_a_run_by_the_run_s_own_row(engine: AsyncEngine) -> None:
    """`run_keys` finds a principal's runs; whether the viewer may see one is still decided on
    the run's own row: keys that say another owner (written by hand, out of step) show nothing
    the run itself does not grant."""
    await finished_history(engine, tenants=TENANTS)
    async with engine.begin() as conn:
        await conn.execute(
            text("UPDATE run_keys SET owner_principal_id = 'alice' WHERE run_id = 'run-1'")
        )
        tenant = (
            await conn.execute(text("SELECT tenant_id FROM runs WHERE run_id = 'run-1'"))
        ).scalar_one()
    async with engine.connect() as conn:
        found, _ = await _listed(Viewer(tenant, "alice"))(conn)
    assert found == []


@pytest.mark.parametrize(
    ("what", "read"),
    [
        ("a page of a run's events", lambda c: runs_repo.read_events(c, "run-1", 0, 100)),
        (
            "the event a webhook delivery carries",
            lambda c: webhook_dispatch.stored_event(c, "run-1", 1),
        ),
    ],
    ids=["events page", "delivered event"],
)
async def test_a_read_of_a_runs_log_finds_each_of_its_parts_by_the_run(
    engine: AsyncEngine, what: str, read: Search
) -> None:
    """The log reads a run's run.queued from its row and each run.started from its attempt's
    (0048): a read of one run's events finds every part of the view by that run's keys."""
    await finished_history(engine, tenants=TENANTS)
    [(sql, params)] = [
        (sql, params)
        for sql, params in await statements_sent(engine, read)
        if "run_event_log" in sql
    ]
    plan = await generic_plan(engine, sql, len(params or ()))
    for table in ("runs", "run_keys", "run_events", "attempts"):
        assert f"Seq Scan on {table}" not in plan, f"{what}:\n{plan}"
