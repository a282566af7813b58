"""Applying every migration to an empty database yields exactly the declared schema."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from services.admission.adapters import normalise
from services.admission.domain import FreshnessPolicy
from services.admission.service import Admitter
from tests.conftest import drop_database
from tether.db.engine import create_engine
from tether.db.migrate import alembic_config, upgrade
from tether.db.schema import metadata
from tether.domain import run_queued, run_started
from tether.stack.embedded import database_url
from tether.v1 import admission_pb2


@pytest_asyncio.fixture(loop_scope="session")
async def empty_db(pg_server_url: str) -> AsyncIterator[str]:
    import asyncpg

    admin = await asyncpg.connect(pg_server_url)
    await admin.execute('CREATE DATABASE "tether_migration_test"')
    await admin.close()
    yield database_url(pg_server_url, "tether_migration_test")
    await drop_database(pg_server_url, "tether_migration_test")


def _diff(conn: Connection) -> list[Any]:
    context = MigrationContext.configure(conn, opts={"compare_type": True})
    return list(compare_metadata(context, metadata))


async def _conversation(conn: AsyncConnection) -> None:
    """Tenant `t`, its session `s` and the message `m` in it: what a run stored names."""
    await conn.execute(text("INSERT INTO tenants (tenant_id, name) VALUES ('t', 't')"))
    await conn.execute(
        text(
            "INSERT INTO sessions (session_id, tenant_id, channel, conversation_id, "
            "actor_scope) VALUES ('s', 't', 'chat', 'c', 'p')"
        )
    )
    await conn.execute(
        text(
            "INSERT INTO messages (message_id, tenant_id, session_id, source, event_id, "
            "actor_type, actor_id, text) VALUES ('m', 't', 's', 'chat', 'e', 'user', 'p', 'hi')"
        )
    )


async def test_every_migration_applied_yields_the_declared_schema(empty_db: str) -> None:
    await upgrade(empty_db)
    engine = create_engine(empty_db, pool_size=1)
    try:
        async with engine.connect() as conn:
            diff = await conn.run_sync(_diff)
            head = (await conn.execute(text("SELECT version_num FROM alembic_version"))).scalar()
    finally:
        await engine.dispose()
    assert diff == []
    assert head == ScriptDirectory.from_config(alembic_config()).get_current_head()


async def test_migrations_are_idempotent_to_rerun(empty_db: str) -> None:
    await upgrade(empty_db)
    await upgrade(empty_db)  # a restarted stack runs upgrade again; it must be a no-op


async def test_parts_stored_before_superseding_are_marked_where_a_retry_replaced_them(
    empty_db: str,
) -> None:
    """0009: a call stored cut, and an unfinished part of a completed run, were replaced by a
    later attempt; the last words of a failed run and every finished part stay as they were."""
    await upgrade(empty_db, "0008")
    engine = create_engine(empty_db, pool_size=1)
    run = (
        "INSERT INTO runs (run_id, tenant_id, session_id, message_id, conversation_id, channel, "
        "input_text, status, max_attempts, root_run_id, visibility) VALUES "
        "(:r, 't', 's', 'm', 'c', 'chat', 'hi', :status, 3, :r, 'private')"
    )
    part = (
        "INSERT INTO run_parts (run_id, part_index, role, kind, payload, final) VALUES "
        "(:r, :i, 'assistant', :kind, CAST(:payload AS jsonb), :final)"
    )
    stored = [
        ("run_done", 0, "text", '{"text": "Hel"}', False),  # cut off, answered again
        ("run_done", 1, "tool_call", '{"toolCallId": "a", "cut": true}', True),
        ("run_done", 2, "text", '{"text": "Hello."}', True),
        ("run_failed", 0, "text", '{"text": "Hel"}', False),  # the last thing it said
    ]
    try:
        async with engine.begin() as conn:
            await _conversation(conn)
            for run_id, status in (("run_done", "completed"), ("run_failed", "failed")):
                await conn.execute(text(run), {"r": run_id, "status": status})
            for run_id, index, kind, payload, final in stored:
                await conn.execute(
                    text(part),
                    {"r": run_id, "i": index, "kind": kind, "payload": payload, "final": final},
                )
        await upgrade(empty_db)
        async with engine.connect() as conn:
            rows = (
                await conn.execute(
                    text(
                        "SELECT run_id, part_index, superseded_at IS NOT NULL AS superseded, "
                        "lease_epoch FROM run_parts ORDER BY run_id, part_index"
                    )
                )
            ).all()
    finally:
        await engine.dispose()
    assert [(r.run_id, r.part_index, r.superseded) for r in rows] == [
        ("run_done", 0, True),
        ("run_done", 1, True),
        ("run_done", 2, False),
        ("run_failed", 0, False),
    ]
    assert {r.lease_epoch for r in rows} == {None}, "which attempt wrote them is not known"


async def test_browser_credentials_come_after_existing_keys_and_go_with_their_key(
    empty_db: str,
) -> None:
    """0016: a new table beside the keys a database already holds; a credential goes with its
    key, and is a session or a token only."""
    await upgrade(empty_db, "0015")
    engine = create_engine(empty_db, pool_size=1)
    credential = (
        "INSERT INTO browser_credentials (credential_id, kind, secret_hash, key_id, tenant_id, "
        "principal_id, scopes, expires_at) VALUES (:c, :kind, :h, 'k', 't', 'p', "
        "ARRAY['runs:read'], now() + interval '1 hour')"
    )
    try:
        async with engine.begin() as conn:
            await conn.execute(text("INSERT INTO tenants (tenant_id, name) VALUES ('t', 't')"))
            await conn.execute(
                text(
                    "INSERT INTO api_keys (key_id, tenant_id, principal_id, key_hash, scopes) "
                    "VALUES ('k', 't', 'p', '\\x01', ARRAY['runs:read'])"
                )
            )
        await upgrade(empty_db)
        async with engine.begin() as conn:
            await conn.execute(text(credential), {"c": "c1", "kind": "session", "h": b"\x02"})
            await conn.execute(text(credential), {"c": "c2", "kind": "token", "h": b"\x03"})
        with pytest.raises(IntegrityError):
            async with engine.begin() as conn:
                await conn.execute(text(credential), {"c": "c3", "kind": "cookie", "h": b"\x04"})
        async with engine.begin() as conn:
            await conn.execute(text("DELETE FROM api_keys WHERE key_id = 'k'"))
            left = (await conn.execute(text("SELECT count(*) FROM browser_credentials"))).scalar()
    finally:
        await engine.dispose()
    assert left == 0


async def test_a_stored_thread_or_task_session_goes_to_the_principal_of_its_first_run(
    empty_db: str,
) -> None:
    """0019: a thread's or a task's session, shared by whoever named it until now, belongs to
    the principal of its first run with a known owner; after it, that principal's next message
    joins it and another principal's opens a conversation of its own."""
    await upgrade(empty_db, "0018")
    engine = create_engine(empty_db, pool_size=1)
    session = (
        "INSERT INTO sessions (session_id, tenant_id, channel, conversation_id, actor_scope) "
        "VALUES (:s, 't', :channel, :conversation, :scope)"
    )
    message = (
        "INSERT INTO messages (message_id, tenant_id, session_id, source, event_id, actor_type, "
        "actor_id, text) VALUES (:s, 't', :s, 'messaging', :s, 'guest', 'g', 'hi')"
    )
    run = (
        "INSERT INTO runs (run_id, tenant_id, session_id, message_id, conversation_id, channel, "
        "input_text, status, max_attempts, root_run_id, visibility, owner_principal_id, "
        "created_at) VALUES (:r, 't', :s, :s, 'c', 'x', 'hi', 'completed', 3, :r, 'tenant', "
        ":owner, now() - make_interval(mins => :age))"
    )
    stored = {
        # session: (channel, conversation, scope, its runs' owners oldest first)
        "s_thread": ("whatsapp", "th-1", "thread", [None, "alice", "bob"]),
        "s_task": ("task", "T-9", "task", ["tracker", "bob"]),
        "s_chat": ("chat", "c-1", "principal:carol", ["carol"]),
        "s_unknown": ("whatsapp", "th-2", "thread", [None]),
    }
    try:
        async with engine.begin() as conn:
            await conn.execute(text("INSERT INTO tenants (tenant_id, name) VALUES ('t', 't')"))
            for s, (channel, conversation, scope, owners) in stored.items():
                values = {"s": s, "channel": channel, "conversation": conversation}
                await conn.execute(text(session), {**values, "scope": scope})
                await conn.execute(text(message), values)
                for i, owner in enumerate(owners):
                    age = len(owners) - i
                    await conn.execute(
                        text(run), {"r": f"{s}_{i}", "s": s, "owner": owner, "age": age}
                    )
        await upgrade(empty_db)
        async with engine.connect() as conn:
            rows = await conn.execute(text("SELECT session_id, actor_scope FROM sessions"))
            scopes = {row.session_id: row.actor_scope for row in rows}
        assert scopes == {
            "s_thread": "thread:alice",
            "s_task": "task:tracker",
            "s_chat": "principal:carol",
            "s_unknown": "thread",
        }

        admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())

        async def in_thread(principal: str, event_id: str) -> str:
            caller = admission_pb2.Caller(tenant_id="t", principal_id=principal)
            messaging = admission_pb2.MessagingWebhookInput(
                provider="whatsapp",
                provider_event_id=event_id,
                thread_id="th-1",
                sender_id="g",
                text="hi",
            )
            request = admission_pb2.AdmitRequest(caller=caller, messaging=messaging)
            return str((await admitter.admit(normalise(request))).run.session_id)

        assert await in_thread("alice", "e-1") == "s_thread"
        assert await in_thread("bob", "e-2") not in stored
    finally:
        await engine.dispose()


async def test_run_keys_are_backfilled_and_kept_in_step_with_runs(empty_db: str) -> None:
    """0046: the runs stored before it have their keys in `run_keys`; a run a release before's
    code inserts afterwards (a plain INSERT, as its admission's) gets them too, loses them when
    it is deleted, and an UPDATE setting a key moves them."""
    await upgrade(empty_db, "0045")
    engine = create_engine(empty_db, pool_size=1)
    run = (
        "INSERT INTO runs (run_id, tenant_id, session_id, message_id, conversation_id, channel, "
        "input_text, status, max_attempts, root_run_id, visibility, owner_principal_id) "
        "VALUES (:r, 't', 's', 'm', 'c', 'chat', 'hi', 'completed', 3, :r, 'private', :owner)"
    )
    keys = (
        "SELECT k.run_id, k.tenant_id, k.owner_principal_id, k.session_id, k.message_id, "
        "k.created_at = r.created_at AS same_time FROM run_keys k JOIN runs r USING (run_id) "
        "ORDER BY k.run_id"
    )
    try:
        async with engine.begin() as conn:
            await _conversation(conn)
            await conn.execute(
                text(run), [{"r": "r_old", "owner": "p"}, {"r": "r_none", "owner": None}]
            )
        await upgrade(empty_db)
        async with engine.begin() as conn:
            await conn.execute(text(run), {"r": "r_new", "owner": "q"})
            found = [tuple(row) for row in await conn.execute(text(keys))]
            await conn.execute(text("DELETE FROM runs WHERE run_id = 'r_old'"))
            # An operator's UPDATE that sets a key moves it; the services' never set one.
            await conn.execute(
                text(
                    "UPDATE runs SET owner_principal_id = 'p2', "
                    "created_at = created_at - interval '1 hour' WHERE run_id = 'r_none'"
                )
            )
            left = [tuple(row) for row in await conn.execute(text(keys))]
    finally:
        await engine.dispose()
    assert found == [
        ("r_new", "t", "q", "s", "m", True),
        ("r_none", "t", None, "s", "m", True),
        ("r_old", "t", "p", "s", "m", True),
    ]
    assert left == [("r_new", "t", "q", "s", "m", True), ("r_none", "t", "p2", "s", "m", True)]


async def test_the_contract_keeps_what_names_a_session_or_a_message_found_without_scanning_runs(
    empty_db: str,
) -> None:
    """0047 drops the four lookup indexes of runs that run_keys replaced. What referred to a
    session or a message by them still holds: a run cannot name a session or a message that is
    not there, a session or a message cannot go while a run names it, and removing one (as
    retention does, once its runs are gone) checks that without reading all of runs."""
    await upgrade(empty_db)
    engine = create_engine(empty_db, pool_size=1)
    run = (
        "INSERT INTO runs (run_id, tenant_id, session_id, message_id, conversation_id, channel, "
        "input_text, status, max_attempts, root_run_id, visibility) "
        "VALUES (:r, 't', :s, :m, 'c', 'chat', 'hi', 'completed', 3, :r, 'private')"
    )
    scans = text(
        "SELECT coalesce(sum(seq_scan), 0) FROM pg_stat_xact_user_tables "
        "WHERE relname IN ('runs', 'run_keys')"
    )
    try:
        async with engine.begin() as conn:
            await _conversation(conn)
            await conn.execute(text(run), {"r": "r_1", "s": "s", "m": "m"})
        indexes = await _index_names(engine, "runs")
        for missing in ({"s": "s_gone", "m": "m"}, {"s": "s", "m": "m_gone"}):
            with pytest.raises(IntegrityError):
                async with engine.begin() as conn:
                    await conn.execute(text(run), {"r": "r_2", **missing})
        for held in ("DELETE FROM messages WHERE message_id = 'm'", "DELETE FROM sessions"):
            with pytest.raises(IntegrityError):
                async with engine.begin() as conn:
                    await conn.execute(text(held))
        async with engine.begin() as conn:
            await conn.execute(text("DELETE FROM runs"))
        async with engine.begin() as conn:
            before = (await conn.execute(scans)).scalar_one()
            await conn.execute(text("DELETE FROM messages WHERE message_id = 'm'"))
            await conn.execute(text("DELETE FROM sessions WHERE session_id = 's'"))
            scanned = (await conn.execute(scans)).scalar_one() - before
    finally:
        await engine.dispose()
    assert not indexes & {
        "ix_runs_tenant_created",
        "ix_runs_tenant_owner_created",
        "ix_runs_session_created",
        "ix_runs_message",
    }
    assert scanned == 0, (
        f"removing a message and a session read all of runs or run_keys {scanned} times"
    )


async def _index_names(engine: Any, table: str) -> set[str]:
    async with engine.connect() as conn:
        found = await conn.execute(
            text("SELECT indexname FROM pg_indexes WHERE tablename = :t"), {"t": table}
        )
        return {row[0] for row in found}


def _downgrade(conn: Connection, revision: str) -> None:
    from alembic import command

    cfg = alembic_config()
    cfg.attributes["connection"] = conn
    command.downgrade(cfg, revision)


async def test_queued_and_started_are_read_from_their_records_once_and_written_back_going_down(
    empty_db: str,
) -> None:
    """0048: a run's run.queued is read from its row (why it was queued, by its lineage) and a
    lease's run.started from its attempt's (its `event_seq`), as their constructors build them;
    those the release before stored as `run_events` rows (a seq 1 row, an attempt without
    `event_seq`) are read as before; none is read twice. On the way back to 0047, each one read
    from a row is written into `run_events`: none is lost."""
    await upgrade(empty_db, "0047")
    engine = create_engine(empty_db, pool_size=1)
    run = (
        "INSERT INTO runs (run_id, tenant_id, session_id, message_id, conversation_id, channel, "
        "input_text, status, max_attempts, root_run_id, visibility, last_seq, parent_run_id, "
        "tree_parent_run_id) VALUES (:r, 't', 's', 'm', 'c', 'chat', 'hi', 'running', 3, :r, "
        "'private', 2, :retried, :parent)"
    )
    event = (
        "INSERT INTO run_events (run_id, seq, type, payload, format) "
        "VALUES (:r, :seq, :type, CAST(:payload AS jsonb), 2)"
    )
    log = text("SELECT run_id, seq, type, payload, format FROM run_event_log ORDER BY run_id, seq")
    started = dict(run_started(1, "w", 1).payload)

    def queued(reason: str) -> dict[str, Any]:
        return dict(run_queued(1, reason).payload)

    try:
        async with engine.begin() as conn:
            await _conversation(conn)
            # Admitted and leased by the release before: both events rows of the log.
            await conn.execute(text(run), {"r": "r_before", "retried": None, "parent": None})
            for seq, made in ((1, run_queued(1, "admitted")), (2, run_started(1, "w", 1))):
                values = {"seq": seq, "type": str(made.type), "payload": json.dumps(made.payload)}
                await conn.execute(text(event), {"r": "r_before", **values})
            await conn.execute(
                text(
                    "INSERT INTO attempts (run_id, lease_epoch, attempt, worker_id) "
                    "VALUES ('r_before', 1, 1, 'w')"
                )
            )
        await upgrade(empty_db)
        async with engine.begin() as conn:
            # This release's: no event rows; a retry of r_before's delivery, a child of it, and
            # a run admitted, whose attempt holds the seq of its run.started.
            for run_id, retried, parent in (
                ("r_now", None, None),
                ("r_redelivered", "r_before", None),
                ("r_child", None, "r_before"),
            ):
                await conn.execute(text(run), {"r": run_id, "retried": retried, "parent": parent})
            await conn.execute(
                text(
                    "INSERT INTO attempts (run_id, lease_epoch, attempt, worker_id, event_seq) "
                    "VALUES ('r_now', 1, 1, 'w', 2)"
                )
            )
        async with engine.connect() as conn:
            read = [tuple(row) for row in await conn.execute(log)]
            rows = (
                await conn.execute(
                    text("SELECT count(*) FROM run_events WHERE run_id <> 'r_before'")
                )
            ).scalar_one()
            times = (
                await conn.execute(
                    text(
                        "SELECT e.type, e.created_at = CASE e.type WHEN 'run.queued' "
                        "THEN r.created_at ELSE a.started_at END FROM run_event_log e "
                        "JOIN runs r USING (run_id) JOIN attempts a USING (run_id) "
                        "WHERE e.run_id = 'r_now' ORDER BY e.seq"
                    )
                )
            ).all()
        async with engine.begin() as conn:
            await conn.run_sync(_downgrade, "0047")
        async with engine.connect() as conn:
            back = [tuple(row) for row in await conn.execute(log)]
            stored = await conn.execute(text("SELECT count(*) FROM run_events"))
            stored_rows = stored.scalar_one()
    finally:
        await engine.dispose()
    expected = [
        ("r_before", 1, "run.queued", queued("admitted"), 2),
        ("r_before", 2, "run.started", started, 2),
        ("r_child", 1, "run.queued", queued("delegated"), 2),
        ("r_now", 1, "run.queued", queued("admitted"), 2),
        ("r_now", 2, "run.started", started, 2),
        ("r_redelivered", 1, "run.queued", queued("redelivered"), 2),
    ]
    assert read == expected
    assert rows == 0, "this release stores neither event as a row"
    assert [tuple(t) for t in times] == [("run.queued", True), ("run.started", True)]
    assert back == expected
    assert stored_rows == len(expected)
