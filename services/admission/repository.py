"""All SQL admission runs: claims, sessions, messages and the creation of queued runs."""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Integer,
    LargeBinary,
    Select,
    Text,
    bindparam,
    exists,
    func,
    insert,
    literal,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection

from services.admission.domain import InboundEvent
from tether.db.schema import event_claims, messages, run_events, runs, sessions
from tether.db.transitions import Event, insert_events
from tether.states import RunStatus


def _build_admit_new() -> Select[Any]:
    """The admission statement, built once with bind parameters (building it costs more CPU
    than PostgreSQL spends running it)."""

    def p(name: str, type_: Any = Text) -> Any:
        return bindparam(name, type_=type_)

    claim = (
        pg_insert(event_claims)
        .values(
            tenant_id=p("tenant_id"),
            scope=p("scope"),
            key=p("key"),
            request_hash=p("request_hash", LargeBinary),
            run_id=p("run_id"),
        )
        .on_conflict_do_nothing()
        .returning(event_claims.c.run_id)
        .cte("claim")
    )
    session = (
        pg_insert(sessions)
        .from_select(
            [
                "session_id",
                "tenant_id",
                "channel",
                "conversation_id",
                "actor_scope",
                "active_run_id",
            ],
            select(
                p("session_id"),
                p("tenant_id"),
                p("channel"),
                p("conversation_id"),
                p("actor_scope"),
                p("run_id"),
            ).where(exists(select(claim.c.run_id))),
        )
        .on_conflict_do_update(
            index_elements=["tenant_id", "channel", "conversation_id", "actor_scope"],
            # An idle session makes this run its head; a busy one keeps its head and this
            # message queues behind it.
            set_={
                "active_run_id": func.coalesce(
                    sessions.c.active_run_id, bindparam("run_id", type_=Text)
                )
            },
        )
        .returning(sessions.c.session_id, sessions.c.active_run_id)
        .cte("session")
    )
    message = (
        insert(messages)
        .from_select(
            [
                "message_id",
                "tenant_id",
                "session_id",
                "source",
                "event_id",
                "actor_type",
                "actor_id",
                "text",
                "context",
            ],
            select(
                p("message_id"),
                p("tenant_id"),
                session.c.session_id,
                p("source"),
                p("event_id"),
                p("actor_type"),
                p("actor_id"),
                p("text"),
                p("context", JSONB),
            ),
        )
        .returning(messages.c.message_id, messages.c.session_id)
        .cte("message")
    )
    run = (
        insert(runs)
        .from_select(
            [
                "run_id",
                "tenant_id",
                "session_id",
                "message_id",
                "conversation_id",
                "channel",
                "input_text",
                "status",
                "attempt",
                "max_attempts",
                "root_run_id",
                "traceparent",
                "last_seq",
                "session_head",
                "owner_principal_id",
                "visibility",
            ],
            select(
                p("run_id"),
                p("tenant_id"),
                message.c.session_id,
                message.c.message_id,
                p("conversation_id"),
                p("channel"),
                p("text"),
                literal(RunStatus.QUEUED.value, Text),
                literal(1, Integer),
                p("max_attempts", Integer),
                p("run_id"),
                p("traceparent"),
                literal(1, BigInteger),
                session.c.active_run_id == p("run_id"),
                p("owner_principal_id"),
                p("visibility"),
            ).select_from(message.join(session, literal(True))),
        )
        .returning(*runs.c)
        .cte("run")
    )
    queued_event = (
        insert(run_events)
        .from_select(
            ["run_id", "seq", "type", "payload"],
            select(
                run.c.run_id,
                literal(1, BigInteger),
                literal("run.queued", Text),
                p("queued_payload", JSONB),
            ),
        )
        .cte("queued_event")
    )
    return select(run).add_cte(queued_event)


_ADMIT_NEW = _build_admit_new()


async def admit_new(
    conn: AsyncConnection,
    *,
    event: InboundEvent,
    request_hash: bytes,
    run_id: str,
    session_id: str,
    message_id: str,
    max_attempts: int,
    traceparent: str | None,
) -> Row[Any] | None:
    """Claim the key, resolve the session, store the message and queue the run, in ONE statement.

    Each step is a data-modifying CTE fed by the previous one, so when the claim conflicts
    nothing else is written and no row comes back (the caller then applies the duplicate
    table); otherwise the queued run comes back. One round trip, atomic by construction.
    """
    params = {
        "tenant_id": event.tenant_id,
        "scope": event.idempotency_scope,
        "key": event.idempotency_key,
        "request_hash": request_hash,
        "run_id": run_id,
        "session_id": session_id,
        "channel": event.channel,
        "conversation_id": event.conversation_id,
        "actor_scope": event.actor_scope,
        "message_id": message_id,
        "source": event.source,
        "event_id": event.event_id,
        "actor_type": event.actor_type,
        "actor_id": event.actor_id,
        "text": event.text,
        "context": event.context,
        "max_attempts": max_attempts,
        "traceparent": traceparent,
        "owner_principal_id": event.principal_id,
        "visibility": event.visibility.value,
        "queued_payload": {"attempt": 1, "reason": "admitted"},
    }
    row: Row[Any] | None = (await conn.execute(_ADMIT_NEW, params)).first()
    return row


_FIND_CLAIM = (
    select(
        event_claims.c.request_hash,
        event_claims.c.claimed_at,
        (func.now() - event_claims.c.claimed_at).label("claim_age"),
        *runs.c,
    )
    .join(runs, runs.c.run_id == event_claims.c.run_id)
    .where(
        event_claims.c.tenant_id == bindparam("tenant_id"),
        event_claims.c.scope == bindparam("scope"),
        event_claims.c.key == bindparam("key"),
    )
)


async def find_claim(conn: AsyncConnection, event: InboundEvent) -> Row[Any]:
    """The claim of the event's key joined with its current run."""
    params = {
        "tenant_id": event.tenant_id,
        "scope": event.idempotency_scope,
        "key": event.idempotency_key,
    }
    return (await conn.execute(_FIND_CLAIM, params)).one()


async def rebind_claim(
    conn: AsyncConnection, event: InboundEvent, previous_run_id: str, run_id: str
) -> bool:
    """Compare-and-swap the claim from `previous_run_id` to `run_id`; False when another won."""
    stmt = (
        update(event_claims)
        .where(
            event_claims.c.tenant_id == event.tenant_id,
            event_claims.c.scope == event.idempotency_scope,
            event_claims.c.key == event.idempotency_key,
            event_claims.c.run_id == previous_run_id,
        )
        .values(run_id=run_id, claimed_at=func.now())
        .returning(event_claims.c.run_id)
    )
    return (await conn.execute(stmt)).first() is not None


async def insert_queued_run(
    conn: AsyncConnection,
    *,
    run_id: str,
    event: InboundEvent,
    session_id: str,
    message_id: str,
    max_attempts: int,
    parent_run_id: str | None,
    root_run_id: str,
    reason: str,
    traceparent: str | None,
) -> Row[Any]:
    """Create a queued run with its `run.queued` event (seq 1); it heads its session when
    the session is idle."""
    head = (
        await conn.execute(
            update(sessions)
            .where(sessions.c.session_id == session_id)
            .values(active_run_id=func.coalesce(sessions.c.active_run_id, run_id))
            .returning(sessions.c.active_run_id)
        )
    ).scalar_one()
    stmt = (
        insert(runs)
        .values(
            run_id=run_id,
            tenant_id=event.tenant_id,
            session_id=session_id,
            message_id=message_id,
            conversation_id=event.conversation_id,
            channel=event.channel,
            input_text=event.text,
            status=RunStatus.QUEUED.value,
            attempt=1,
            max_attempts=max_attempts,
            parent_run_id=parent_run_id,
            root_run_id=root_run_id,
            traceparent=traceparent,
            last_seq=1,
            session_head=head == run_id,
            owner_principal_id=event.principal_id,
            visibility=event.visibility.value,
        )
        .returning(*runs.c)
    )
    row = (await conn.execute(stmt)).one()
    await insert_events(conn, run_id, 0, [Event("run.queued", {"attempt": 1, "reason": reason})])
    return row
