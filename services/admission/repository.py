"""All SQL admission runs: claims, sessions, messages and the creation of queued runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    Integer,
    LargeBinary,
    Select,
    Text,
    bindparam,
    exists,
    func,
    insert,
    literal,
    null,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection

from services.admission.domain import InboundEvent
from services.orchestrator.repositories import intake
from tether.db.schema import event_claims, messages, sessions


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
            set_={"active_run_id": intake.head_if_idle(p("run_id"))},
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
    run, queued_event = intake.queued_run(
        select(
            p("run_id"),
            p("tenant_id"),
            message.c.session_id,
            message.c.message_id,
            p("conversation_id"),
            p("channel"),
            p("text"),
            p("max_attempts", Integer),
            null(),
            p("run_id"),
            p("traceparent"),
            session.c.active_run_id == p("run_id"),
            p("owner_principal_id"),
            p("visibility"),
        ).select_from(message.join(session, literal(True)))
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
        **intake.queued_params("admitted"),
    }
    row: Row[Any] | None = (await conn.execute(_ADMIT_NEW, params)).first()
    return row


@dataclass(frozen=True)
class Claim:
    """An inbound event's claim and the run it points at now."""

    request_hash: bytes
    age_s: float
    run: Row[Any]


_FIND_CLAIM = select(
    event_claims.c.request_hash,
    event_claims.c.run_id,
    func.extract("epoch", func.now() - event_claims.c.claimed_at).label("age_s"),
).where(
    event_claims.c.tenant_id == bindparam("tenant_id"),
    event_claims.c.scope == bindparam("scope"),
    event_claims.c.key == bindparam("key"),
)


async def find_claim(conn: AsyncConnection, event: InboundEvent) -> Claim:
    """The claim of the event's key and its current run."""
    params = {
        "tenant_id": event.tenant_id,
        "scope": event.idempotency_scope,
        "key": event.idempotency_key,
    }
    claim = (await conn.execute(_FIND_CLAIM, params)).one()
    run = await intake.claimed_run(conn, claim.run_id)
    return Claim(claim.request_hash, float(claim.age_s), run)


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
    """Create a queued run of an existing session with its run.queued event; it heads its
    session when the session is idle."""
    facts = {
        "run_id": run_id,
        "tenant_id": event.tenant_id,
        "session_id": session_id,
        "message_id": message_id,
        "conversation_id": event.conversation_id,
        "channel": event.channel,
        "input_text": event.text,
        "max_attempts": max_attempts,
        "parent_run_id": parent_run_id,
        "root_run_id": root_run_id,
        "traceparent": traceparent,
        "owner_principal_id": event.principal_id,
        "visibility": event.visibility.value,
    }
    return await intake.create_queued_run(conn, facts, reason=reason)
