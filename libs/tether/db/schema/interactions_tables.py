"""The interactions service's tables: questions, approvals and connections in the loop, the
grants approvals mint, and the tenants' sealed secrets."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    DateTime,
    ForeignKey,
    Index,
    LargeBinary,
    PrimaryKeyConstraint,
    SmallInteger,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

from tether.db.schema.base import _now, metadata

interactions = Table(
    "interactions",
    metadata,
    Column("interaction_id", Text, primary_key=True),
    Column("tenant_id", Text, nullable=False),
    # An interaction is part of its run's story: removing the run (retention, a tenant's
    # deletion) removes it in the same statement.
    Column("run_id", Text, ForeignKey("runs.run_id", ondelete="CASCADE"), nullable=False),
    Column("session_id", Text, nullable=False),
    # question | approval | connection
    Column("kind", Text, nullable=False),
    # pending -> answered | decided | completed | expired; decided|expired -> claimed (approvals);
    # pending -> orphaned when its run never parked on it (the storing worker died first)
    Column("status", Text, nullable=False),
    # The lease epoch it was stored under: only that lease can still park the run on it.
    Column("lease_epoch", BigInteger),
    # Why it was closed without a person (e.g. orphaned).
    Column("reason", Text),
    Column("tool_call_id", Text, nullable=False),
    # Questions: the specs and the answers.
    Column("questions", JSONB),
    Column("answers", JSONB),
    # Approvals: what runs is what was shown.
    Column("tool_name", Text),
    Column("input", JSONB),
    Column("risk_category", Text),
    Column("summary", Text),
    Column("estimated_cost_micros", BigInteger),
    Column("idempotency_key", Text),
    Column("decision", Text),
    Column("decided_by", Text),
    Column("claimed_epoch", BigInteger),
    # What the run's agent's approval policy offers on it (0021); NULL for an approval of a run
    # routed before agents were documents, whose tenant's policy decides.
    Column("offered_decisions", ARRAY(Text)),
    Column("always_allow_scopes", ARRAY(Text)),
    # Connections: the consent offer, bound to the tenant and the principal who must complete it.
    Column("provider", Text),
    Column("gap", Text),
    Column("scopes", ARRAY(Text)),
    Column("principal_id", Text),
    Column("oauth_state_hash", LargeBinary, unique=True),
    Column("login_url", Text),
    # An MCP server's consent (0033): its discovered token endpoint, the client id the URL
    # named, and the PKCE code verifier sealed (bound to tenant, principal, provider); never
    # given to anyone, read once by the callback's code exchange.
    Column("oauth_token_endpoint", Text),
    Column("oauth_client_id", Text),
    Column("verifier_ciphertext", LargeBinary),
    Column("verifier_nonce", LargeBinary),
    Column("verifier_key_id", Text),
    Column("expires_at", DateTime(timezone=True)),
    _now(),
    Column("resolved_at", DateTime(timezone=True)),
    Column("claimed_at", DateTime(timezone=True)),
    # When the orchestrator took the resolution (resumed the run, or had moved on).
    Column("delivered_at", DateTime(timezone=True)),
    # When the orchestrator named it as the one its run is parked on (checked once).
    Column("bound_at", DateTime(timezone=True)),
    # The stored format of the row's JSON payloads (tether.formats); 1 for rows stored before
    # formats were recorded, and for rows a release that does not know them writes.
    Column("format", SmallInteger, nullable=False, server_default=text("1")),
    CheckConstraint("kind IN ('question', 'approval', 'connection')", name="kind"),
    CheckConstraint(
        "status IN ('pending', 'answered', 'decided', 'completed', 'expired', 'claimed', "
        "'orphaned')",
        name="status",
    ),
)
Index("ix_interactions_run", interactions.c.run_id, interactions.c.created_at)
Index(
    "ix_interactions_open_expiry",
    interactions.c.expires_at,
    postgresql_where=interactions.c.status == "pending",
)
Index(
    "ix_interactions_unconfirmed",
    interactions.c.created_at,
    postgresql_where=text("status = 'pending' AND bound_at IS NULL"),
)
Index(
    "ix_interactions_undelivered",
    interactions.c.resolved_at,
    postgresql_where=text(
        "status IN ('answered', 'decided', 'completed', 'expired') AND delivered_at IS NULL"
    ),
)

grants = Table(
    "grants",
    metadata,
    Column("grant_id", Text, primary_key=True),
    Column("tenant_id", Text, nullable=False),
    # conversation | principal | tenant | category
    Column("scope", Text, nullable=False),
    Column("session_id", Text),
    Column("principal_id", Text),
    Column("tool_name", Text),
    Column("risk_category", Text),
    Column("granted_by", Text, nullable=False),
    # The decision that minted it; empty for grants an administrator provisioned, and once the
    # decision's run was removed under retention (the grant stands; audit_log keeps who decided).
    Column("interaction_id", Text, ForeignKey("interactions.interaction_id", ondelete="SET NULL")),
    _now(),
    CheckConstraint("scope IN ('conversation', 'principal', 'tenant', 'category')", name="scope"),
)
Index("ix_grants_tenant", grants.c.tenant_id)
Index(
    "ix_grants_interaction",
    grants.c.interaction_id,
    postgresql_where=grants.c.interaction_id.is_not(None),
)

connections = Table(
    "connections",
    metadata,
    Column("tenant_id", Text, nullable=False),
    Column("principal_id", Text, nullable=False),
    Column("provider", Text, nullable=False),
    Column("scopes", ARRAY(Text), nullable=False),
    # Plaintext, as releases before 0023 stored it: '' once sealed. The previous release reads
    # it during a rollout; interactions seals and clears any it finds (dropped in 0.3.0).
    Column("access_token", Text, nullable=False),
    # The token sealed (services.interactions.sealing), bound to tenant, principal, provider.
    Column("token_ciphertext", LargeBinary),
    Column("token_nonce", LargeBinary),
    Column("token_key_id", Text),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    # An MCP server's connection (0033): where and as whom to refresh it, the refresh token
    # sealed as the access token is.
    Column("oauth_token_endpoint", Text),
    Column("oauth_client_id", Text),
    Column("refresh_ciphertext", LargeBinary),
    Column("refresh_nonce", LargeBinary),
    Column("refresh_key_id", Text),
    _now(),
    PrimaryKeyConstraint("tenant_id", "principal_id", "provider"),
)

secrets = Table(
    "secrets",
    metadata,
    Column("tenant_id", Text, nullable=False),
    Column("name", Text, nullable=False),
    # AES-GCM under the key `key_id` names, bound to (tenant_id, name): never the value.
    Column("ciphertext", LargeBinary, nullable=False),
    Column("nonce", LargeBinary, nullable=False),
    Column("key_id", Text, nullable=False),
    # What a read may show of the value, so a person can tell two apart.
    Column("last_four", Text, nullable=False),
    Column("created_by", Text, nullable=False),
    _now(),
    PrimaryKeyConstraint("tenant_id", "name"),
)

channel_connections = Table(
    "channel_connections",
    metadata,
    Column("tenant_id", Text, nullable=False),
    Column("channel_id", Text, nullable=False),
    Column("kind", Text, nullable=False),
    Column("name", Text, nullable=False),
    # None: the tenant's routes with source `messaging` and channel = kind choose the agent.
    Column("agent", Text),
    # Where replies go: a provider's API (slack, whatsapp) or the receiver's URL (webhook).
    Column("api_base_url", Text),
    Column("reply_url", Text),
    # The kind's non-secret settings (phone_number_id, the webhook's JSON pointers).
    Column("settings", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    # Every secret of the connection, one JSON object sealed and bound to (tenant, channel).
    Column("ciphertext", LargeBinary, nullable=False),
    Column("nonce", LargeBinary, nullable=False),
    Column("key_id", Text, nullable=False),
    # Each secret's name and last four characters: what a read may show.
    Column("secret_hints", JSONB, nullable=False),
    # The verification secret a rotation replaced, still accepted until previous_expires_at.
    Column("previous_ciphertext", LargeBinary),
    Column("previous_nonce", LargeBinary),
    Column("previous_key_id", Text),
    Column("previous_expires_at", DateTime(timezone=True)),
    Column("created_by", Text, nullable=False),
    _now(),
    PrimaryKeyConstraint("tenant_id", "channel_id"),
    CheckConstraint("kind IN ('slack', 'whatsapp', 'webhook')", name="channel_connections_kind"),
    # A webhook names its connection by id alone: the gateway finds the tenant from it.
    Index("channel_connections_channel_id", "channel_id", unique=True),
    Index("channel_connections_name", "tenant_id", "name", unique=True),
)

# A run-event webhook subscription's signing secret (the subscription is the orchestrator's).
webhook_secrets = Table(
    "webhook_secrets",
    metadata,
    Column("tenant_id", Text, nullable=False),
    Column("subscription_id", Text, nullable=False),
    # AES-GCM under the key `key_id` names, bound to (tenant_id, subscription_id).
    Column("ciphertext", LargeBinary, nullable=False),
    Column("nonce", LargeBinary, nullable=False),
    Column("key_id", Text, nullable=False),
    _now(),
    PrimaryKeyConstraint("tenant_id", "subscription_id"),
)
