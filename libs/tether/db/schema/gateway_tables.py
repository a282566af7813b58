"""The gateway's tables: tenants, their API keys, and the browser credentials minted from those."""

from __future__ import annotations

from sqlalchemy import (
    CheckConstraint,
    Column,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

from tether.db.schema.base import _now, metadata

tenants = Table(
    "tenants",
    metadata,
    Column("tenant_id", Text, primary_key=True),
    Column("name", Text, nullable=False),
    # Agent routing overrides (model, persona, tools, limits); merged over the defaults.
    Column("agent", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    # Tenant policy, e.g. which approval decisions are permitted.
    Column("policy", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    _now(),
    # The tenant's share of the pool against the others' (fair leases), and how many of its runs
    # may run at once (None: no cap); the operator's (`tether tenant set`), read by the claim.
    Column("weight", Integer, nullable=False, server_default=text("1")),
    Column("max_running", Integer),
    CheckConstraint("weight > 0", name="weight"),
    CheckConstraint("max_running IS NULL OR max_running >= 0", name="max_running"),
)

# The capped tenants, for the claim (it leaves out those it did not lock first).
Index("ix_tenants_capped", tenants.c.tenant_id, postgresql_where=tenants.c.max_running.is_not(None))

api_keys = Table(
    "api_keys",
    metadata,
    Column("key_id", Text, primary_key=True),
    Column("tenant_id", Text, ForeignKey("tenants.tenant_id"), nullable=False),
    Column("principal_id", Text, nullable=False),
    # SHA-256 of the whole secret; keys are 256-bit random so a slow hash adds nothing.
    Column("key_hash", LargeBinary, nullable=False, unique=True),
    Column("scopes", ARRAY(Text), nullable=False),
    _now(),
    Column("revoked_at", DateTime(timezone=True)),
    # Set at creation; an expired key is refused like a revoked one.
    Column("expires_at", DateTime(timezone=True)),
)

# Browser sign-in (owned by the gateway): a console's session cookie or an embedding app's
# short-lived token, each minted from an API key and dying with it (revoked: the lookup joins
# the key; deleted with its tenant: ON DELETE CASCADE). Only the secret's SHA-256 is stored.
browser_credentials = Table(
    "browser_credentials",
    metadata,
    Column("credential_id", Text, primary_key=True),
    Column("kind", Text, nullable=False),
    Column("secret_hash", LargeBinary, nullable=False, unique=True),
    Column("key_id", Text, ForeignKey("api_keys.key_id", ondelete="CASCADE"), nullable=False),
    Column("tenant_id", Text, nullable=False),
    Column("principal_id", Text, nullable=False),
    Column("scopes", ARRAY(Text), nullable=False),
    _now(),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    Column("revoked_at", DateTime(timezone=True)),
    CheckConstraint("kind IN ('session', 'token')", name="kind"),
)
# A key's credentials, for removing its expired ones when it mints another.
Index("ix_browser_credentials_key_id", browser_credentials.c.key_id)
# The gateway's sweep: the expired credentials, soonest first, and when the next one expires.
Index("ix_browser_credentials_expires_at", browser_credentials.c.expires_at)
