"""Run-event webhooks, owned by the orchestrator (it owns the events they carry): a tenant's
subscriptions and their delivery log. The signing secrets are interactions'
(`webhook_secrets`), never here."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    DateTime,
    ForeignKeyConstraint,
    Index,
    Integer,
    PrimaryKeyConstraint,
    Table,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY

from tether.db.schema.base import _now, metadata

webhook_subscriptions = Table(
    "webhook_subscriptions",
    metadata,
    Column("tenant_id", Text, nullable=False),
    Column("subscription_id", Text, nullable=False),
    Column("url", Text, nullable=False),
    Column("events", ARRAY(Text), nullable=False),
    Column("created_by", Text, nullable=False),
    _now(),
    # Set once its endpoint failed for the disable window; nothing new is recorded for it then.
    Column("disabled_at", DateTime(timezone=True)),
    # The first failure since its last success: the disable window counts from here.
    Column("failing_since", DateTime(timezone=True)),
    # Events committed before this (less the dispatcher's look-back) were recorded already.
    Column("scanned_until", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("tenant_id", "subscription_id"),
)

webhook_deliveries = Table(
    "webhook_deliveries",
    metadata,
    Column("tenant_id", Text, nullable=False),
    # The webhook-id header: the same on every try and on a redelivery.
    Column("delivery_id", Text, nullable=False),
    Column("subscription_id", Text, nullable=False),
    Column("run_id", Text, nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("event_type", Text, nullable=False),
    Column("status", Text, nullable=False, server_default=text("'pending'")),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    # When a pending delivery is due; while a replica sends it, the end of that replica's claim.
    Column("next_attempt_at", DateTime(timezone=True), server_default=func.now()),
    # The first try since it was recorded or redelivered: it is given up a disable window later.
    Column("first_attempt_at", DateTime(timezone=True)),
    Column("last_http_status", Integer),
    Column("last_error", Text),
    Column("sent_at", DateTime(timezone=True)),
    _now(),
    PrimaryKeyConstraint("tenant_id", "delivery_id"),
    UniqueConstraint("tenant_id", "subscription_id", "run_id", "seq"),
    ForeignKeyConstraint(
        ["tenant_id", "subscription_id"],
        ["webhook_subscriptions.tenant_id", "webhook_subscriptions.subscription_id"],
        ondelete="CASCADE",
    ),
    CheckConstraint("status IN ('pending', 'sent', 'failed')", name="status"),
)
# The dispatcher's search: pending deliveries by when they are due.
Index(
    "ix_webhook_deliveries_due",
    webhook_deliveries.c.next_attempt_at,
    postgresql_where=webhook_deliveries.c.status == "pending",
)
# A subscription's log, newest first.
Index(
    "ix_webhook_deliveries_log",
    webhook_deliveries.c.tenant_id,
    webhook_deliveries.c.subscription_id,
    webhook_deliveries.c.created_at.desc(),
)
