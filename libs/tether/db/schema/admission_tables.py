"""Admission's tables: conversations (sessions), inbound messages, the event claims that make
admission idempotent, and the schedules whose ticks it admits."""

from __future__ import annotations

from sqlalchemy import (
    CheckConstraint,
    Column,
    DateTime,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    PrimaryKeyConstraint,
    Table,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB

from tether.db.schema.base import _now, metadata

sessions = Table(
    "sessions",
    metadata,
    Column("session_id", Text, primary_key=True),
    Column("tenant_id", Text, ForeignKey("tenants.tenant_id"), nullable=False),
    Column("channel", Text, nullable=False),
    Column("conversation_id", Text, nullable=False),
    # Whose conversation it is: its kind and the principal that holds it (`principal:alice`
    # for a chat, `thread:alice`, `task:alice`). An external id is only a correlation value:
    # another principal naming it gets a conversation of its own (migration 0019).
    Column("actor_scope", Text, nullable=False),
    # The session's head: the run that may execute (set at admission when the session is free,
    # handed to the next queued message when the head finishes). NULL when idle.
    Column("active_run_id", Text),
    _now(),
    UniqueConstraint("tenant_id", "channel", "conversation_id", "actor_scope"),
)

messages = Table(
    "messages",
    metadata,
    Column("message_id", Text, primary_key=True),
    Column("tenant_id", Text, nullable=False),
    Column("session_id", Text, ForeignKey("sessions.session_id"), nullable=False),
    Column("source", Text, nullable=False),
    Column("event_id", Text, nullable=False),
    Column("actor_type", Text, nullable=False),
    Column("actor_id", Text, nullable=False),
    Column("text", Text, nullable=False),
    Column("context", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    # Where a channel connection's message came from and its answer goes
    # (`tether.domain.channels`); NULL for every other message.
    Column("channel_origin", JSONB),
    _now(),
)
# Retention: a tenant's messages oldest first, and a session's (to find whether it is empty).
Index(
    "ix_messages_tenant_created", messages.c.tenant_id, messages.c.created_at, messages.c.message_id
)
Index("ix_messages_session", messages.c.session_id)


event_claims = Table(
    "event_claims",
    metadata,
    Column("tenant_id", Text, nullable=False),
    Column("scope", Text, nullable=False),
    Column("key", Text, nullable=False),
    Column("request_hash", LargeBinary, nullable=False),
    # NULL once the run was removed under the tenant's retention policy: the claim stays as the
    # event's tombstone, so a late duplicate is still recognised (and never runs again).
    Column("run_id", Text),
    # Refreshed whenever ownership moves to a new run, so a retried claim is not born stale.
    Column("claimed_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    _now(),
    PrimaryKeyConstraint("tenant_id", "scope", "key"),
    # Deferred: the claim is inserted first (a duplicate then costs one statement), the run
    # it points to later in the same transaction. SET NULL: removing a run (retention) turns
    # its claim into a tombstone in the same statement, so no moment leaves the key unclaimed.
    ForeignKeyConstraint(
        ["run_id"], ["runs.run_id"], deferrable=True, initially="DEFERRED", ondelete="SET NULL"
    ),
)
# The claim of a run (retention's SET NULL, a retry by run id).
Index("ix_event_claims_run", event_claims.c.run_id)
# Tombstones oldest first, per tenant (retention).
Index(
    "ix_event_claims_tombstones",
    event_claims.c.tenant_id,
    event_claims.c.claimed_at,
    postgresql_where=event_claims.c.run_id.is_(None),
)


schedules = Table(
    "schedules",
    metadata,
    Column("tenant_id", Text, nullable=False),
    Column("schedule_id", Text, nullable=False),
    # Who added it: each tick's run is this principal's.
    Column("principal_id", Text, nullable=False),
    Column("agent", Text, nullable=False),
    Column("cron", Text, nullable=False),
    Column("timezone", Text, nullable=False),
    Column("message", Text, nullable=False),
    Column("overlap", Text, nullable=False),
    Column("catch_up", Text, nullable=False),
    Column("catch_up_window_s", Integer, nullable=False),
    # The earliest tick not yet fired; a ticker claims the schedule once this has passed and
    # moves it on in the transaction that admits the tick's run.
    Column("next_fire_at", DateTime(timezone=True), nullable=False),
    # Set while paused: no ticker picks it.
    Column("paused_at", DateTime(timezone=True)),
    # The last tick that admitted a run, and that run (the overlap policy asks whether it is
    # still active; no foreign key: retention removes runs on the orchestrator's own terms).
    Column("last_tick_at", DateTime(timezone=True)),
    Column("last_run_id", Text),
    _now(),
    PrimaryKeyConstraint("tenant_id", "schedule_id"),
    CheckConstraint("overlap IN ('skip', 'allow')", name="overlap"),
    CheckConstraint("catch_up IN ('latest', 'none', 'all')", name="catch_up"),
)
# The tickers' search: the schedules due, earliest first, paused ones left out.
Index(
    "ix_schedules_due",
    schedules.c.next_fire_at,
    postgresql_where=schedules.c.paused_at.is_(None),
)
