"""The whole schema as SQLAlchemy Core tables, each beside its indexes.

Ownership (which service writes which table) follows DESIGN.md: the gateway owns tenants and API
keys; admission owns claims, sessions and messages and creates the queued run; the orchestrator owns
runs after creation, their events, parts, attempts, effects, usage and audit.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Computed,
    DateTime,
    ForeignKey,
    ForeignKeyConstraint,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    SmallInteger,
    Table,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, TSVECTOR

from tether.states import RunStatus

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)


def _now() -> Column[object]:
    return Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now())


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
)

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

sessions = Table(
    "sessions",
    metadata,
    Column("session_id", Text, primary_key=True),
    Column("tenant_id", Text, ForeignKey("tenants.tenant_id"), nullable=False),
    Column("channel", Text, nullable=False),
    Column("conversation_id", Text, nullable=False),
    # Who may share state within the conversation: a principal, or the whole thread.
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
    _now(),
)
# Retention: a tenant's messages oldest first, and a session's (to find whether it is empty).
Index(
    "ix_messages_tenant_created", messages.c.tenant_id, messages.c.created_at, messages.c.message_id
)
Index("ix_messages_session", messages.c.session_id)

# Routing decisions, each stored once, named by the digest of its content (`routing_id`): a
# run's row names the one its attempt runs with instead of carrying it whole through every
# version of the row.
routings = Table(
    "routings",
    metadata,
    Column("routing_id", Text, primary_key=True),
    Column("config", JSONB, nullable=False),
    _now(),
)

runs = Table(
    "runs",
    metadata,
    Column("run_id", Text, primary_key=True),
    Column("tenant_id", Text, nullable=False),
    Column("session_id", Text, ForeignKey("sessions.session_id"), nullable=False),
    Column("message_id", Text, ForeignKey("messages.message_id"), nullable=False),
    Column("conversation_id", Text, nullable=False),
    Column("channel", Text, nullable=False),
    Column("input_text", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("attempt", Integer, nullable=False, server_default=text("1")),
    Column("max_attempts", Integer, nullable=False),
    Column("lease_owner", Text),
    Column("lease_epoch", BigInteger, nullable=False, server_default=text("0")),
    Column("lease_expires_at", DateTime(timezone=True)),
    Column("next_attempt_at", DateTime(timezone=True)),
    Column("cancel_requested_at", DateTime(timezone=True)),
    Column("waiting_interaction_id", Text),
    # Lineage: the run a retried delivery replaces, and the first run of the chain.
    Column("parent_run_id", Text, ForeignKey("runs.run_id")),
    Column("root_run_id", Text, nullable=False),
    Column("result_text", Text),
    Column("task_outcome", Text),
    Column("warnings", ARRAY(Text), nullable=False, server_default=text("'{}'::text[]")),
    Column("error", JSONB),
    Column("usage", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    # Routing decision of the current attempt, resolved before the loop: `routing_id` names it
    # in `routings`. `config` held it whole before routings existed (the release before still
    # reads it during a rolling deploy); it is no longer written, and goes in a later release.
    Column("config", JSONB),
    Column("routing_id", Text),
    Column("traceparent", Text),
    Column("last_seq", BigInteger, nullable=False, server_default=text("0")),
    # Whether the run is its session's head (sessions.active_run_id): only a head runs, so
    # a conversation's messages run one at a time, in order.
    Column("session_head", Boolean, nullable=False, server_default=text("false")),
    # The last checkpoint batch of the current lease that landed (see Checkpoint.batch).
    Column("checkpoint_batch", BigInteger, nullable=False, server_default=text("0")),
    # The principal of the authenticated key that admitted the run (tether.visibility): whose
    # standing grants and connected accounts it may use, and who sees it. NULL only for runs
    # admitted before owners were recorded whose owner is unknown (runs:all keys see them).
    Column("owner_principal_id", Text),
    # private (a chat run) | tenant (admitted by an integration key).
    Column("visibility", Text, nullable=False),
    # The stored format of the row's JSON payloads (tether.formats); 1 for rows stored before
    # formats were recorded, and for rows a release that does not know them writes.
    Column("format", SmallInteger, nullable=False, server_default=text("1")),
    _now(),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("started_at", DateTime(timezone=True)),
    Column("finished_at", DateTime(timezone=True)),
    CheckConstraint(
        "status IN (" + ", ".join(f"'{s.value}'" for s in RunStatus) + ")", name="status"
    ),
    CheckConstraint("visibility IN ('private', 'tenant')", name="visibility"),
)
Index("ix_runs_tenant_created", runs.c.tenant_id, runs.c.created_at.desc(), runs.c.run_id.desc())
# A principal's runs, newest first (ListRuns of a key without runs:all).
Index(
    "ix_runs_tenant_owner_created",
    runs.c.tenant_id,
    runs.c.owner_principal_id,
    runs.c.created_at.desc(),
    runs.c.run_id.desc(),
)
Index("ix_runs_session_created", runs.c.session_id, runs.c.created_at)
# The claim's whole search: claimable runs in arrival order, one index, no join.
Index(
    "ix_runs_claimable",
    runs.c.created_at,
    runs.c.run_id,
    postgresql_where=(runs.c.status == "queued") & runs.c.session_head,
)
# Finding a session's next message when its head finishes.
Index(
    "ix_runs_session_queued",
    runs.c.session_id,
    runs.c.created_at,
    runs.c.run_id,
    postgresql_where=runs.c.status == "queued",
)
Index("ix_runs_lease_expiry", runs.c.lease_expires_at, postgresql_where=runs.c.status == "running")
# Retention: a tenant's finished runs oldest first; whether a message still has a run; the runs
# that retried a run (only retried runs have a parent).
Index(
    "ix_runs_tenant_finished",
    runs.c.tenant_id,
    runs.c.finished_at,
    runs.c.run_id,
    postgresql_where=runs.c.finished_at.is_not(None),
)
Index("ix_runs_message", runs.c.message_id)
Index("ix_runs_parent", runs.c.parent_run_id, postgresql_where=runs.c.parent_run_id.is_not(None))
Index(
    "ix_runs_retry_due",
    runs.c.next_attempt_at,
    postgresql_where=runs.c.status == "retry-pending",
)

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

run_events = Table(
    "run_events",
    metadata,
    Column("run_id", Text, ForeignKey("runs.run_id"), nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("type", Text, nullable=False),
    Column("payload", JSONB, nullable=False),
    # The stored format of the row's JSON payloads (tether.formats); 1 for rows stored before
    # formats were recorded, and for rows a release that does not know them writes.
    Column("format", SmallInteger, nullable=False, server_default=text("1")),
    _now(),
    PrimaryKeyConstraint("run_id", "seq"),
)

run_parts = Table(
    "run_parts",
    metadata,
    Column("run_id", Text, ForeignKey("runs.run_id"), nullable=False),
    Column("part_index", Integer, nullable=False),
    Column("role", Text, nullable=False),
    Column("kind", Text, nullable=False),
    Column("payload", JSONB, nullable=False),
    Column("final", Boolean, nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    # The attempt that wrote the part: its attempts row is (run_id, lease_epoch). NULL for parts
    # stored before attempts were recorded on them.
    Column("lease_epoch", BigInteger),
    # When a later attempt took the part's place (its attempt was cut off before the model's
    # turn ended, or it is a tool call whose input never arrived whole): kept for audit, left
    # out of every transcript read and of the history sent to the model.
    Column("superseded_at", DateTime(timezone=True)),
    # The stored format of the row's JSON payloads (tether.formats); 1 for rows stored before
    # formats were recorded, and for rows a release that does not know them writes.
    Column("format", SmallInteger, nullable=False, server_default=text("1")),
    PrimaryKeyConstraint("run_id", "part_index"),
)

attempts = Table(
    "attempts",
    metadata,
    Column("run_id", Text, ForeignKey("runs.run_id"), nullable=False),
    Column("lease_epoch", BigInteger, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("worker_id", Text, nullable=False),
    Column("started_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("ended_at", DateTime(timezone=True)),
    Column("outcome", Text),
    Column("error", JSONB),
    # Stage durations in ms: routing, context, attempt, finalisation, total.
    Column("stages", JSONB),
    PrimaryKeyConstraint("run_id", "lease_epoch"),
)

effects = Table(
    "effects",
    metadata,
    Column("tenant_id", Text, nullable=False),
    Column("key", Text, nullable=False),
    Column("run_id", Text, ForeignKey("runs.run_id"), nullable=False),
    # Lease epoch of the holder that began it; another epoch finding it in progress knows the
    # holder lost its lease (fencing allows one live epoch per run) and re-fires with the key.
    Column("owner_epoch", BigInteger, nullable=False, server_default=text("0")),
    Column("tool_name", Text, nullable=False),
    Column("state", Text, nullable=False),
    Column("result", JSONB),
    _now(),
    Column("finished_at", DateTime(timezone=True)),
    PrimaryKeyConstraint("tenant_id", "key"),
    CheckConstraint("state IN ('in-progress', 'done')", name="state"),
)
Index("ix_effects_run", effects.c.run_id)

usage_turns = Table(
    "usage_turns",
    metadata,
    Column("id", BigInteger, Identity(), primary_key=True),
    Column("run_id", Text, ForeignKey("runs.run_id"), nullable=False),
    Column("model", Text, nullable=False),
    Column("input_tokens", BigInteger, nullable=False),
    Column("output_tokens", BigInteger, nullable=False),
    Column("cache_creation_input_tokens", BigInteger, nullable=False),
    Column("cache_read_input_tokens", BigInteger, nullable=False),
    Column("cost_micros", BigInteger, nullable=False),
    _now(),
)
Index("ix_usage_turns_run", usage_turns.c.run_id)

tool_outputs = Table(
    "tool_outputs",
    metadata,
    Column("output_ref", Text, primary_key=True),
    Column("run_id", Text, ForeignKey("runs.run_id"), nullable=False),
    Column("content", Text, nullable=False),
    _now(),
)
Index("ix_tool_outputs_run", tool_outputs.c.run_id)

# The summaries that stand in for a session's earlier runs in the history sent to the model
# (context compaction), one per range (a summary covers the session's runs up to and including
# `through_run_id`, a previous summary's included): the claim finds a session's latest here.
# The summary itself is a part of the run that wrote it (`run_id`, `part_index`).
context_summaries = Table(
    "context_summaries",
    metadata,
    Column("session_id", Text, nullable=False),
    # The runs it covers may be removed by retention (no run reads them any more): not a key.
    Column("through_run_id", Text, nullable=False),
    Column("through_created_at", DateTime(timezone=True), nullable=False),
    Column("run_id", Text, nullable=False),
    Column("part_index", Integer, nullable=False),
    _now(),
    PrimaryKeyConstraint("session_id", "through_run_id"),
    # It goes with the run that holds it (retention, a tenant's deletion).
    ForeignKeyConstraint(
        ["run_id", "part_index"],
        ["run_parts.run_id", "run_parts.part_index"],
        ondelete="CASCADE",
    ),
)
Index(
    "ix_context_summaries_latest",
    context_summaries.c.session_id,
    context_summaries.c.through_created_at.desc(),
)

# A tenant's knowledge: documents it uploads, retrieved for a run's context by full-text search
# (`search`, PostgreSQL's english configuration over title and content). Only the tenant's own
# runs ever retrieve them.
documents = Table(
    "documents",
    metadata,
    Column("document_id", Text, primary_key=True),
    Column("tenant_id", Text, nullable=False),
    Column("title", Text, nullable=False),
    Column("content", Text, nullable=False),
    # The principal whose key uploaded it.
    Column("created_by", Text, nullable=False),
    Column(
        "search",
        TSVECTOR,
        Computed("to_tsvector('english'::regconfig, title || ' ' || content)", persisted=True),
        nullable=False,
    ),
    _now(),
)
Index(
    "ix_documents_tenant_created",
    documents.c.tenant_id,
    documents.c.created_at.desc(),
    documents.c.document_id.desc(),
)
Index("ix_documents_search", documents.c.search, postgresql_using="gin")

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

# -- interactions (owned by the interactions service) ------------------------------------------

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
    # Connections: the consent offer, bound to the tenant and the principal who must complete it.
    Column("provider", Text),
    Column("gap", Text),
    Column("scopes", ARRAY(Text)),
    Column("principal_id", Text),
    Column("oauth_state_hash", LargeBinary, unique=True),
    Column("login_url", Text),
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
    # The provider's access token; a production deployment keeps it in a secret store.
    Column("access_token", Text, nullable=False),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    _now(),
    PrimaryKeyConstraint("tenant_id", "principal_id", "provider"),
)
