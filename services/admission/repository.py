"""All SQL admission runs: claims, sessions, messages and the creation of queued runs; their
retention (tombstones, messages no run names, empty sessions) and a deleted tenant's removal."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    Float,
    Integer,
    Interval,
    LargeBinary,
    Select,
    Text,
    bindparam,
    delete,
    exists,
    func,
    insert,
    literal,
    null,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection

from services.admission.domain import InboundEvent
from services.orchestrator.repositories import intake
from tether.db.direct import Direct
from tether.db.schema import event_claims, messages, schedules, sessions
from tether.domain import Run, origin_to_json
from tether.errors import NotFound
from tether.retention import Key, walk_params


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
                "channel_origin",
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
                p("channel_origin", JSONB(none_as_null=True)),
            ),
        )
        .returning(messages.c.message_id, messages.c.session_id)
        .cte("message")
    )
    run = intake.queued_run(
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
    return select(run, intake.RACED)


# Admission's statement (bench.topology_floor sends it on a bare driver connection, to measure
# what its records cost apart from the service around it).
ADMIT_NEW = Direct(_build_admit_new())


async def admit_new(conn: AsyncConnection, params: Mapping[str, Any]) -> Run | None:
    """Claim the key, resolve the session, store the message and queue the run, in ONE statement.

    Each step is a data-modifying CTE fed by the previous one, so when the claim conflicts
    nothing else is written and no row comes back (the caller then applies the duplicate
    table); otherwise the queued run comes back. One round trip, atomic by construction.
    `params`: what `admit_params` gives.
    """
    found = queued(await ADMIT_NEW.first(conn, params))
    if found is None:
        return None
    return await intake.retag(conn, found.run) if found.raced else found.run


@dataclass(frozen=True)
class Queued:
    """The run `ADMIT_NEW` queued, and whether its start tag fell through (`intake.retag`)."""

    run: Run
    raced: bool


def queued(row: Row[Any] | None) -> Queued | None:
    """What `ADMIT_NEW`'s row says: None for no row (the claim conflicted; nothing written)."""
    if row is None:
        return None
    return Queued(Run.from_row(row._mapping), bool(row.fair_raced))


def admit_params(
    *,
    event: InboundEvent,
    request_hash: bytes,
    run_id: str,
    session_id: str,
    message_id: str,
    max_attempts: int,
    traceparent: str | None,
) -> dict[str, Any]:
    """The values `ADMIT_NEW` binds to admit `event` as the run `run_id`, in a new session
    `session_id` (unless its conversation has one) with the message `message_id`."""
    return {
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
        "channel_origin": (
            None if event.channel_origin is None else origin_to_json(event.channel_origin)
        ),
        "max_attempts": max_attempts,
        "traceparent": traceparent,
        "owner_principal_id": event.principal_id,
        "visibility": event.visibility.value,
        **intake.queued_params(event.tenant_id, event.priority),
    }


@dataclass(frozen=True)
class Claim:
    """An inbound event's claim and the run it points at now (None: a tombstone, the run was
    removed under the tenant's retention policy)."""

    request_hash: bytes
    age_s: float
    run: Run | None


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
    run = None
    if claim.run_id is not None:
        # Removed since the claim was read: the claim is its tombstone now.
        with contextlib.suppress(NotFound):
            run = await intake.claimed_run(conn, claim.run_id)
    return Claim(claim.request_hash, float(claim.age_s), run)


@dataclass(frozen=True)
class ClaimKey:
    """What identifies an inbound event's claim."""

    tenant_id: str
    scope: str
    key: str

    @classmethod
    def of(cls, event: InboundEvent) -> ClaimKey:
        """The claim key of an inbound event."""
        return cls(event.tenant_id, event.idempotency_scope, event.idempotency_key)


_CLAIM_OF_RUN = select(event_claims.c.tenant_id, event_claims.c.scope, event_claims.c.key).where(
    event_claims.c.run_id == bindparam("run_id")
)


async def claim_of_run(conn: AsyncConnection, run_id: str) -> ClaimKey | None:
    """The claim that points at the run now; None when it points at a later run (the run was
    retried)."""
    row = (await conn.execute(_CLAIM_OF_RUN, {"run_id": run_id})).first()
    return None if row is None else ClaimKey(row.tenant_id, row.scope, row.key)


async def rebind_claim(
    conn: AsyncConnection, claim: ClaimKey, previous_run_id: str, run_id: str
) -> bool:
    """Compare-and-swap the claim from `previous_run_id` to `run_id`; False when another won."""
    stmt = (
        update(event_claims)
        .where(
            event_claims.c.tenant_id == claim.tenant_id,
            event_claims.c.scope == claim.scope,
            event_claims.c.key == claim.key,
            event_claims.c.run_id == previous_run_id,
        )
        .values(run_id=run_id, claimed_at=func.now())
        .returning(event_claims.c.run_id)
    )
    return (await conn.execute(stmt)).first() is not None


async def insert_retry(conn: AsyncConnection, *, run_id: str, previous: Run) -> Run:
    """Create the queued run that retries `previous` (a failed or cancelled run) for the same
    message, with lineage; it heads its session when the session is idle."""
    facts = {
        "run_id": run_id,
        "tenant_id": previous.tenant_id,
        "session_id": previous.session_id,
        "message_id": previous.message_id,
        "conversation_id": previous.conversation_id,
        "channel": previous.channel,
        "input_text": previous.input_text,
        "max_attempts": previous.max_attempts,
        "parent_run_id": previous.run_id,
        "root_run_id": previous.root_run_id,
        "traceparent": previous.traceparent,
        "owner_principal_id": previous.owner_principal_id,
        "visibility": previous.visibility,
    }
    return await intake.create_queued_run(conn, facts)


# -- retention -----------------------------------------------------------------------------------

_KEEP = bindparam("keep", type_=Interval)
_AFTER = tuple_(bindparam("after_at"), bindparam("after_id"))
_IDS = bindparam("ids", type_=ARRAY(Text))


_MESSAGES_AFTER = (
    messages.c.tenant_id == bindparam("tenant_id"),
    tuple_(messages.c.created_at, messages.c.message_id) > _AFTER,
)
_EXPIRED_MESSAGES = (
    select(messages.c.created_at, messages.c.message_id)
    .where(*_MESSAGES_AFTER, messages.c.created_at < func.now() - _KEEP)
    .order_by(messages.c.created_at, messages.c.message_id)
    .limit(bindparam("batch"))
    .with_for_update(skip_locked=True)
)
_NEXT_MESSAGE_EXPIRY = (
    select(func.extract("epoch", messages.c.created_at + _KEEP - func.now()).cast(Float))
    .where(*_MESSAGES_AFTER)
    .order_by(messages.c.created_at, messages.c.message_id)
    .limit(1)
)
# Checked again after the lock was granted: a retry inserted meanwhile names the message.
_REMOVE_MESSAGES = (
    delete(messages)
    .where(
        messages.c.message_id == func.any(_IDS),
        ~intake.message_has_run(messages.c.message_id),
    )
    .returning(messages.c.session_id)
)
_EMPTY = ~exists().where(messages.c.session_id == sessions.c.session_id)
# A session's messages went: lock it (an admission upserting it holds it, and is skipped)...
_LOCK_SESSIONS = (
    select(sessions.c.session_id)
    .where(sessions.c.session_id == func.any(_IDS), sessions.c.active_run_id.is_(None))
    .with_for_update(skip_locked=True)
)
# ...and remove it when none came since (a message always comes with its run).
_REMOVE_SESSIONS = delete(sessions).where(
    sessions.c.session_id == func.any(_IDS), sessions.c.active_run_id.is_(None), _EMPTY
)


async def lock_expired_messages(
    conn: AsyncConnection, tenant_id: str, keep_s: float, after: Key | None, batch: int
) -> list[Key]:
    """Lock up to `batch` of the tenant's messages older than `keep_s`, oldest first after
    the key `after`; their keys (one someone holds is skipped)."""
    rows = await conn.execute(_EXPIRED_MESSAGES, walk_params(tenant_id, keep_s, after, batch))
    return [(row.created_at, row.message_id) for row in rows]


async def remove_unused_messages(conn: AsyncConnection, message_ids: Sequence[str]) -> int:
    """Remove those of the locked messages that no run names, then their sessions if that
    left them empty and idle; how many messages were removed."""
    sessions_of = list((await conn.execute(_REMOVE_MESSAGES, {"ids": list(message_ids)})).scalars())
    if sessions_of:
        locked = (await conn.execute(_LOCK_SESSIONS, {"ids": sorted(set(sessions_of))})).scalars()
        await conn.execute(_REMOVE_SESSIONS, {"ids": list(locked)})
    return len(sessions_of)


async def next_message_expiry_in(
    conn: AsyncConnection, tenant_id: str, keep_s: float, after: Key | None
) -> float | None:
    """The seconds until the tenant's first message after the key `after` is older than
    `keep_s`; None when none came after it."""
    params = walk_params(tenant_id, keep_s, after, 1)
    value = (await conn.execute(_NEXT_MESSAGE_EXPIRY, params)).scalar()
    return None if value is None else float(value)


_TOMBSTONES = event_claims.c.tenant_id == bindparam("tenant_id"), event_claims.c.run_id.is_(None)
_EXPIRED_TOMBSTONES = (
    select(event_claims.c.tenant_id, event_claims.c.scope, event_claims.c.key)
    .where(*_TOMBSTONES, event_claims.c.claimed_at < func.now() - _KEEP)
    .order_by(event_claims.c.claimed_at)
    .limit(bindparam("batch"))
    .with_for_update(skip_locked=True)
    .cte("expired")
)
_REMOVE_TOMBSTONES = select(
    select(func.count())
    .select_from(
        delete(event_claims)
        .where(
            tuple_(event_claims.c.tenant_id, event_claims.c.scope, event_claims.c.key).in_(
                select(_EXPIRED_TOMBSTONES)
            )
        )
        .returning(event_claims.c.key)
        .cte("gone")
    )
    .scalar_subquery()
)
_NEXT_TOMBSTONE_EXPIRY = (
    select(func.extract("epoch", event_claims.c.claimed_at + _KEEP - func.now()).cast(Float))
    .where(*_TOMBSTONES)
    .order_by(event_claims.c.claimed_at)
    .limit(1)
)


async def remove_expired_tombstones(
    conn: AsyncConnection, tenant_id: str, keep_s: float, batch: int
) -> int:
    """Remove up to `batch` of the tenant's tombstones claimed more than `keep_s` ago."""
    params = walk_params(tenant_id, keep_s, None, batch)
    return int((await conn.execute(_REMOVE_TOMBSTONES, params)).scalar() or 0)


async def next_tombstone_expiry_in(
    conn: AsyncConnection, tenant_id: str, keep_s: float
) -> float | None:
    """The seconds until the tenant's oldest tombstone is older than `keep_s`; None for none."""
    params = walk_params(tenant_id, keep_s, None, 1)
    value = (await conn.execute(_NEXT_TOMBSTONE_EXPIRY, params)).scalar()
    return None if value is None else float(value)


# -- a deleted tenant ----------------------------------------------------------------------------

_TENANT_CLAIMS = select(event_claims.c.scope, event_claims.c.key).where(
    event_claims.c.tenant_id == bindparam("tenant_id")
)
_TENANT_MESSAGES = select(messages.c.message_id).where(
    messages.c.tenant_id == bindparam("tenant_id")
)
_TENANT_SESSIONS = select(sessions.c.session_id).where(
    sessions.c.tenant_id == bindparam("tenant_id"), _EMPTY
)


async def delete_tenant_rows(conn: AsyncConnection, tenant_id: str, batch: int) -> int:
    """Remove up to `batch` each of a deleted tenant's claims (tombstones too), messages no
    run names, and sessions left empty (their heads were the tenant's runs, gone first);
    how many rows in all."""
    params = {"tenant_id": tenant_id}
    claims = await conn.execute(
        delete(event_claims).where(
            event_claims.c.tenant_id == tenant_id,
            tuple_(event_claims.c.scope, event_claims.c.key).in_(
                _TENANT_CLAIMS.limit(batch).with_for_update(skip_locked=True)
            ),
        ),
        params,
    )
    unused = (
        _TENANT_MESSAGES.where(~intake.message_has_run(messages.c.message_id))
        .limit(batch)
        .with_for_update(skip_locked=True)
    )
    gone_messages = await conn.execute(
        delete(messages).where(messages.c.message_id.in_(unused)), params
    )
    gone_sessions = await conn.execute(
        delete(sessions).where(
            sessions.c.session_id.in_(
                _TENANT_SESSIONS.limit(batch).with_for_update(skip_locked=True)
            )
        ),
        params,
    )
    return sum(int(r.rowcount or 0) for r in (claims, gone_messages, gone_sessions))


async def tenant_has_rows(conn: AsyncConnection, tenant_id: str) -> bool:
    """Whether any claim, message, session or schedule of the tenant is left."""
    left = select(
        exists(_TENANT_CLAIMS)
        | exists(_TENANT_MESSAGES)
        | exists(select(sessions.c.session_id).where(sessions.c.tenant_id == tenant_id))
        | exists(select(schedules.c.schedule_id).where(schedules.c.tenant_id == tenant_id))
    )
    return bool((await conn.execute(left, {"tenant_id": tenant_id})).scalar())
