"""The interactions service keeps out of the run aggregate: every statement of its repository,
run against the real PostgreSQL, names none of the orchestrator's tables. What it needs of a run
(whose it is, its conversation, its pause, its lease) it asks the orchestrator over gRPC."""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.admission.domain import FreshnessPolicy
from services.admission.service import Admitter
from services.interactions import repository as repo
from services.interactions.sealing import Sealed
from tests.integration.test_admission import _tenant, chat

# The run aggregate, written and read only by the orchestrator (admission creates the run).
RUN_AGGREGATE = ("runs", "run_events", "run_parts", "attempts", "effects", "usage_turns")
_NAMES_RUN_TABLE = re.compile(rf"\b({'|'.join(RUN_AGGREGATE)})\b")

Call = Callable[[AsyncConnection, str, str], Awaitable[Any]]
INTERACTION = "int_tables"
STATE = b"state-hash"

# One call of every repository function, in an order where each finds what the earlier ones
# stored (so the statements that run are the ones a real request runs).
CALLS: dict[str, Call] = {
    "insert_interaction": lambda conn, run_id, session_id: repo.insert_interaction(
        conn,
        interaction_id=INTERACTION,
        tenant_id="t1",
        run_id=run_id,
        session_id=session_id,
        principal_id="alice",
        kind="approval",
        tool_call_id="toolu_1",
        lease_epoch=1,
        tool_name="publish_post",
        input={"text": "hi"},
        risk_category="publish",
        oauth_state_hash=STATE,
    ),
    "bound_interaction": lambda conn, run_id, _: repo.bound_interaction(
        conn, run_id, INTERACTION, "approval", lock=True
    ),
    "has_interactions": lambda conn, run_id, _: repo.has_interactions(conn, run_id),
    "interaction_by_state": lambda conn, *_: repo.interaction_by_state(conn, STATE),
    "expired_pending": lambda conn, *_: repo.expired_pending(conn, 10),
    "unconfirmed_pending": lambda conn, *_: repo.unconfirmed_pending(conn, 0.0, 10),
    "mark_bound": lambda conn, *_: repo.mark_bound(conn, INTERACTION),
    "resolve": lambda conn, *_: repo.resolve(conn, INTERACTION, "decided", decision="allow-once"),
    "close_unresolved": lambda conn, *_: repo.close_unresolved(
        conn, INTERACTION, "orphaned", "the run never parked on it"
    ),
    "undelivered": lambda conn, *_: repo.undelivered(conn, 10),
    "next_expiry_in": lambda conn, *_: repo.next_expiry_in(conn),
    "next_binding_check_in": lambda conn, *_: repo.next_binding_check_in(conn, 10.0),
    "next_redelivery_in": lambda conn, *_: repo.next_redelivery_in(conn),
    "mark_delivered": lambda conn, *_: repo.mark_delivered(conn, INTERACTION),
    "claim_approval": lambda conn, run_id, _: repo.claim_approval(
        conn, run_id, "toolu_1", "publish_post", 1
    ),
    "answered_questions": lambda conn, run_id, _: repo.answered_questions(conn, run_id),
    "insert_grant": lambda conn, *_: repo.insert_grant(
        conn,
        grant_id="grt_tables",
        tenant_id="t1",
        scope="principal",
        principal_id="alice",
        tool_name="publish_post",
        granted_by="alice",
        interaction_id=INTERACTION,
    ),
    "find_grant": lambda conn, _, session_id: repo.find_grant(
        conn,
        tenant_id="t1",
        session_id=session_id,
        principal_id="alice",
        tool_name="publish_post",
        risk_category="publish",
    ),
    "tenant_policy": lambda conn, *_: repo.tenant_policy(conn, "t1"),
    "upsert_connection": lambda conn, *_: repo.upsert_connection(
        conn,
        tenant_id="t1",
        principal_id="alice",
        provider="democal",
        scopes=["calendar.read"],
        token=Sealed(b"ciphertext", b"nonce", "k1"),
        expires_at=datetime.now(UTC),
    ),
    "find_connection": lambda conn, *_: repo.find_connection(conn, "t1", "alice", "democal"),
    "plaintext_connections": lambda conn, *_: repo.plaintext_connections(conn, 10),
    "seal_connection_token": lambda conn, *_: repo.seal_connection_token(
        conn, "t1", "alice", "democal", "token", Sealed(b"ciphertext", b"nonce", "k1")
    ),
    "tenant_has_rows": lambda conn, *_: repo.tenant_has_rows(conn, "t1"),
    "delete_tenant_rows": lambda conn, *_: repo.delete_tenant_rows(conn, "t1", 10),
}


def _repository_functions() -> set[str]:
    return {
        name
        for name, fn in inspect.getmembers(repo, inspect.iscoroutinefunction)
        if fn.__module__ == repo.__name__ and not name.startswith("_")  # helpers run inside
    }


def test_every_repository_function_is_exercised() -> None:
    """A function added to the repository is added here too, so its SQL is checked."""
    assert set(CALLS) == _repository_functions()


@pytest.mark.asyncio(loop_scope="session")
async def test_no_statement_of_the_interactions_repository_names_a_run_table(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "t1")
    admitted = await Admitter(engine, max_attempts=3, freshness=FreshnessPolicy()).admit(chat())
    run_id, session_id = admitted.run.run_id, admitted.run.session_id
    statements: list[str] = []

    def record(*args: Any) -> None:
        statements.append(args[2])  # (conn, cursor, statement, parameters, context, many)

    event.listen(engine.sync_engine, "before_cursor_execute", record)
    try:
        async with engine.begin() as conn:
            for name, call in CALLS.items():
                statements.clear()
                await call(conn, run_id, session_id)
                assert statements, f"{name} ran no statement"
                for sql in statements:
                    named = _NAMES_RUN_TABLE.search(sql)
                    assert named is None, f"{name} reads {named.group(1)}: {sql}"
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", record)
