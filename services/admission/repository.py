"""All SQL admission runs: claims, sessions, messages and the creation of queued runs."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection

from services.admission.domain import InboundEvent
from tether.db.schema import event_claims, messages, runs, sessions
from tether.db.transitions import Event, insert_events
from tether.states import RunStatus


async def insert_claim(
    conn: AsyncConnection, event: InboundEvent, request_hash: bytes, run_id: str
) -> bool:
    """Claim the event's key for `run_id`; False when the key was already claimed."""
    stmt = (
        pg_insert(event_claims)
        .values(
            tenant_id=event.tenant_id,
            scope=event.idempotency_scope,
            key=event.idempotency_key,
            request_hash=request_hash,
            run_id=run_id,
        )
        .on_conflict_do_nothing()
        .returning(event_claims.c.run_id)
    )
    return (await conn.execute(stmt)).first() is not None


async def find_claim(conn: AsyncConnection, event: InboundEvent) -> Row[Any]:
    """The claim of the event's key joined with its current run (claim columns prefixed)."""
    stmt = (
        select(
            event_claims.c.request_hash,
            event_claims.c.claimed_at,
            (func.now() - event_claims.c.claimed_at).label("claim_age"),
            *runs.c,
        )
        .join(runs, runs.c.run_id == event_claims.c.run_id)
        .where(
            event_claims.c.tenant_id == event.tenant_id,
            event_claims.c.scope == event.idempotency_scope,
            event_claims.c.key == event.idempotency_key,
        )
    )
    return (await conn.execute(stmt)).one()


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


async def upsert_session(conn: AsyncConnection, event: InboundEvent, session_id: str) -> str:
    """The session id for the event's identity, creating the session on first contact."""
    stmt = (
        pg_insert(sessions)
        .values(
            session_id=session_id,
            tenant_id=event.tenant_id,
            channel=event.channel,
            conversation_id=event.conversation_id,
            actor_scope=event.actor_scope,
        )
        .on_conflict_do_update(
            index_elements=["tenant_id", "channel", "conversation_id", "actor_scope"],
            # A no-op update so RETURNING yields the existing row.
            set_={"tenant_id": sessions.c.tenant_id},
        )
        .returning(sessions.c.session_id)
    )
    return str((await conn.execute(stmt)).scalar_one())


async def insert_message(
    conn: AsyncConnection, event: InboundEvent, session_id: str, message_id: str
) -> None:
    """Store the user message the run answers."""
    await conn.execute(
        insert(messages).values(
            message_id=message_id,
            tenant_id=event.tenant_id,
            session_id=session_id,
            source=event.source,
            event_id=event.event_id,
            actor_type=event.actor_type,
            actor_id=event.actor_id,
            text=event.text,
            context=event.context,
        )
    )


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
    """Create a queued run with its `run.queued` event (seq 1)."""
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
        )
        .returning(*runs.c)
    )
    row = (await conn.execute(stmt)).one()
    await insert_events(conn, run_id, 0, [Event("run.queued", {"attempt": 1, "reason": reason})])
    return row
