"""The append-only journal every service appends its own records to (through tether.audit)."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    Identity,
    Index,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB

from tether.db.schema.base import _now, metadata

audit_log = Table(
    "audit_log",
    metadata,
    Column("id", BigInteger, Identity(), primary_key=True),
    Column("tenant_id", Text, nullable=False),
    Column("run_id", Text),
    Column("action", Text, nullable=False),
    Column("detail", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    _now(),
)
Index("ix_audit_log_run", audit_log.c.run_id)
