"""The orchestrator's tables: the run aggregate (runs, their events, parts, attempts, effects,
usage, tool outputs, routing decisions, context summaries) and a tenant's knowledge documents."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Computed,
    DateTime,
    Double,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Identity,
    Index,
    Integer,
    PrimaryKeyConstraint,
    SmallInteger,
    Table,
    Text,
    column,
    func,
    table,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, TSVECTOR

from tether.db.schema.base import _now, metadata
from tether.states import RunStatus

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

# A page of runs keeps this share for new row versions: a running run's row is rewritten on
# every renewal and checkpoint, and a version that fits on its own page is a HOT update.
RUNS_FILLFACTOR = 70
ATTEMPTS_FILLFACTOR = 50
runs = Table(
    "runs",
    metadata,
    Column("run_id", Text, primary_key=True),
    Column("tenant_id", Text, nullable=False),
    # Its session and message are referred to from `run_keys` (migration 0047), whose indexes
    # by them serve the check when one is removed.
    Column("session_id", Text, nullable=False),
    Column("message_id", Text, nullable=False),
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
    # The agent the run is routed to (the routing's `agent`), written with `routing_id` by the
    # lease that pins it: the claim counts a capped agent's running runs by it (0033).
    Column("agent_name", Text),
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
    # Its order within its tenant's runs (PRIORITIES: 0 high, 1 normal, 2 low), and its start tag
    # among every tenant's (fair leases: start-time fair queueing; see tenant_queues).
    Column("priority", SmallInteger, nullable=False, server_default=text("1")),
    Column("fair_key", Double, nullable=False, server_default=text("0")),
    # Whether its tenant had a cap (tenants.max_running) when it was queued: the claim finds a
    # capped tenant's runs by a probe of its own (ix_runs_capped, as many as its room), not in
    # its fair scan (ix_runs_fair), which a held backlog would slow. Kept in step with the caps
    # by the orchestrator (`caps.CapWatch`).
    Column("capped", Boolean, nullable=False, server_default=text("false")),
    # The agent whose cap (`limits.max_running`) held it back when a claim routed it: the claim
    # finds such a run by a probe of that agent's (ix_runs_agent_held, while the agent has
    # room), not in its fair scan or its tenant's picks, which a held backlog would slow.
    # Cleared by its lease, and by the orchestrator once no cap holds it (`held_agents`).
    Column("held_agent", Text),
    # When its timer wakes a waiting-for-timer run (a `wait_until` call); cleared as it fires.
    Column("next_wake_at", DateTime(timezone=True)),
    # Its run tree (issue 33), apart from the retry lineage above: the run whose `delegate` call
    # `tree_call_id` started it, the tree's root (itself for a run no call started) and how deep
    # it is (0 at the root). `tree_reported_at`: when its parent's log got its child.completed.
    Column("tree_parent_run_id", Text),
    Column("tree_call_id", Text),
    Column("tree_root_run_id", Text),
    Column("tree_depth", Integer, nullable=False, server_default=text("0")),
    Column("tree_reported_at", DateTime(timezone=True)),
    # A child's share of what its parent had left when it started (`Limits` ceilings by name:
    # max_input_tokens, max_output_tokens, max_cost_micros, max_steps), for its whole subtree;
    # NULL for a root, whose agent's limits are its tree's.
    Column("tree_budget", JSONB),
    _now(),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("started_at", DateTime(timezone=True)),
    Column("finished_at", DateTime(timezone=True)),
    CheckConstraint(
        "status IN (" + ", ".join(f"'{s.value}'" for s in RunStatus) + ")", name="status"
    ),
    CheckConstraint("visibility IN ('private', 'tenant')", name="visibility"),
    CheckConstraint("priority IN (0, 1, 2)", name="priority"),
    # Room on each page for the new versions of its running runs' rows (see ix_runs_running).
    postgresql_with={"fillfactor": RUNS_FILLFACTOR},
)
# Its indexes: `run_indexes`.

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

# A run's log as its readers take it, one row an event (a view, 0045 and 0048; every reader of a
# run's events reads here): `run_events` rows, those of several (format 6) taken apart, a run's
# run.queued read from its row, each run.started from its attempt's. `row_seq`: the seq of the row
# holding the event, never below it (a read after a seq bounds it too, for the log's index).
run_event_log = table(
    "run_event_log",
    column("run_id", Text),
    column("seq", BigInteger),
    column("type", Text),
    column("payload", JSONB),
    column("format", SmallInteger),
    column("created_at", DateTime(timezone=True)),
    column("row_seq", BigInteger),
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
    # What the worker reported of how it ended (its audit detail: the model, the usage, the
    # warnings): the attempt's own record of a completion, written with its close (no audit_log
    # row, which keeps the acts of people and the operator). NULL for attempts closed without a
    # report, and for those closed before it was written (0038: their detail is in audit_log).
    Column("detail", JSONB),
    # Its run.started's seq: the log reads the event from here (0048); NULL when a row holds it.
    Column("event_seq", BigInteger),
    PrimaryKeyConstraint("run_id", "lease_epoch"),
    # Half of each page kept for the rows' closes, which triple a row's size: a close is then a
    # HOT update on the same page, with no new primary-key entry (0042).
    postgresql_with={"fillfactor": ATTEMPTS_FILLFACTOR},
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

# A channel run's answer going out (issue 30): one row per run, named by a key derived from the
# tenant, the run and "answer", written BEFORE the provider is called so that a later attempt
# finds it and asks the provider whether the post landed before it posts (never twice).
DELIVERY_STATES = ("pending", "awaiting-approval", "sent", "failed", "unknown", "denied")
deliveries = Table(
    "deliveries",
    metadata,
    Column("tenant_id", Text, nullable=False),
    Column("delivery_id", Text, nullable=False),
    Column("run_id", Text, ForeignKey("runs.run_id"), nullable=False),
    Column("channel_id", Text, nullable=False),
    Column("kind", Text, nullable=False),
    Column("state", Text, nullable=False),
    # What is (or was) sent: the drafted answer, as an approval shows it.
    Column("text", Text, nullable=False),
    Column("provider_message_id", Text),
    # Provider calls made so far, over every attempt of the run.
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("error", JSONB),
    _now(),
    Column("finished_at", DateTime(timezone=True)),
    PrimaryKeyConstraint("tenant_id", "delivery_id"),
    CheckConstraint(
        "state IN ('pending', 'awaiting-approval', 'sent', 'failed', 'unknown', 'denied')",
        name="state",
    ),
)
Index("ix_deliveries_run", deliveries.c.run_id)

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
    # The seq of the turn's usage.updated, which is stored without the turn (stored format 4,
    # `tether.formats`); NULL for a turn written before 0043 or by a release before it, whose
    # usage.updated carries the turn whole.
    Column("event_seq", BigInteger),
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

# A tenant's agents (tether.agent_spec documents): each a name with immutable numbered versions,
# one of them published. Runs are routed among the published versions of a tenant's agents and
# pinned, by their routing, to the version that took them.
agents = Table(
    "agents",
    metadata,
    Column("tenant_id", Text, nullable=False),
    Column("name", Text, nullable=False),
    Column("published_version", Integer, nullable=False),
    _now(),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("tenant_id", "name"),
)

agent_versions = Table(
    "agent_versions",
    metadata,
    Column("tenant_id", Text, nullable=False),
    Column("name", Text, nullable=False),
    Column("version", Integer, nullable=False),
    # The document as its author sent it (JSON or YAML), and its normalised form: `written` is
    # what `show` gives back, `normalised` what routing reads and `diff` compares.
    Column("written", Text, nullable=False),
    Column("normalised", JSONB, nullable=False),
    # sha256 of the normalised form: an apply identical to the published version creates none.
    Column("digest", Text, nullable=False),
    # Who applied it (the audit record's actor).
    Column("created_by", JSONB, nullable=False),
    _now(),
    PrimaryKeyConstraint("tenant_id", "name", "version"),
    ForeignKeyConstraint(
        ["tenant_id", "name"], ["agents.tenant_id", "agents.name"], ondelete="CASCADE"
    ),
    CheckConstraint("version >= 1", name="version"),
)

# Per tenant: which agent is its default (takes the runs no route claims) and the revision of
# its agents, bumped by every apply, rollback, default and removal. The claim compares a run's
# tenant's revision with the one its cached routes were resolved at (one primary-key probe),
# instead of reading every agent of the tenant for every run. A tenant with no row has no
# agents yet and runs with `tenants.agent` as before agents existed.
agent_sets = Table(
    "agent_sets",
    metadata,
    Column("tenant_id", Text, primary_key=True),
    Column("revision", BigInteger, nullable=False),
    Column("default_agent", Text),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    ForeignKeyConstraint(
        ["tenant_id", "default_agent"], ["agents.tenant_id", "agents.name"], name="default_agent"
    ),
)

# The tool catalog: every tool a worker announced in its Work hello, whichever replica it
# reached, one row per name with what the last announcement said. Deployment-wide, not a
# tenant's: every tenant's agents run on the same workers. A row outlives the worker that wrote
# it, so a tool stays nameable while its workers restart or roll out.
tool_catalog = Table(
    "tool_catalog",
    metadata,
    Column("name", Text, primary_key=True),
    Column("schema_sha256", Text, nullable=False),
    Column("risk", Text, nullable=False),
    Column("writes_externally", Boolean, nullable=False),
    Column("announced_by", Text, nullable=False),
    Column("announced_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

# What channel providers reported about messages sent through a connection (WhatsApp's status
# callbacks: sent, delivered, read, failed), one row per message and status, written from the
# gateway's verified webhooks. A delivery finds its own message again by `callback_data` (the
# `biz_opaque_callback_data` it sent: its delivery id). No foreign key to the connection: the
# connections are interactions' and a status may outlive its connection's removal.
channel_statuses = Table(
    "channel_statuses",
    metadata,
    Column("tenant_id", Text, nullable=False),
    Column("channel_id", Text, nullable=False),
    Column("provider_message_id", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("callback_data", Text),
    Column("errors", JSONB),
    Column("reported_at", DateTime(timezone=True), nullable=False),
    Column("recorded_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("tenant_id", "channel_id", "provider_message_id", "status"),
)
Index(
    "ix_channel_statuses_tenant_id_callback_data",
    channel_statuses.c.tenant_id,
    channel_statuses.c.callback_data,
)

# A row per tenant that has queued a run: the row a claim locks to lease within the tenant's
# cap (fair.lock_capped). Its `tail` was the tenant's finish tag before the tags were striped
# (tenant_stripes); a release before still moves it on, this one reads it only to seed stripes.
tenant_queues = Table(
    "tenant_queues",
    metadata,
    Column("tenant_id", Text, ForeignKey("tenants.tenant_id"), primary_key=True),
    Column("tail", Double, nullable=False, server_default=text("0")),
)
Index("ix_tenant_queues_tail", tenant_queues.c.tail)

# Each tenant's finish tag (fair leases, start-time fair queueing), striped over
# fair_tags.STRIPES rows so that the tenant's admissions do not wait for each other: stripe s hands
# out the tenant's tags s, s + STRIPES, s + 2 STRIPES, ... (in steps of 1 / tenants.weight), its
# `tail` the next of them; an admission takes the stripe with the least next tag that no other
# admission holds (intake.queued_run).
tenant_stripes = Table(
    "tenant_stripes",
    metadata,
    Column("tenant_id", Text, ForeignKey("tenants.tenant_id"), nullable=False),
    Column("stripe", SmallInteger, nullable=False),
    Column("tail", Double, nullable=False, server_default=text("0")),
    PrimaryKeyConstraint("tenant_id", "stripe"),
)
Index("ix_tenant_stripes_tail", tenant_stripes.c.tail)

# Model rate limits (README, "Model rate limits"): what each (provider credential, model)'s
# buckets held, written in batches by the replicas that grant from them, so a replica that
# starts refills from there instead of starting full. Deployment-wide, not per tenant: a
# bucket belongs to a provider credential, which every tenant's runs on it share. The
# levels are the pool's (a replica's own level over its share).
model_limit_levels = Table(
    "model_limit_levels",
    metadata,
    Column("credential", Text, nullable=False),
    Column("model", Text, nullable=False),
    Column("requests", Float),
    Column("input_tokens", Float),
    Column("output_tokens", Float),
    Column("measured_at", DateTime(timezone=True), nullable=False),
    Column("replica_id", Text, nullable=False),
    PrimaryKeyConstraint("credential", "model", name="pk_model_limit_levels"),
)

# The replicas granting from those buckets: each one's connected workers, refreshed with the
# levels; a replica's share of every limit is its workers over the live replicas' workers.
model_limit_replicas = Table(
    "model_limit_replicas",
    metadata,
    Column("replica_id", Text, primary_key=True),
    Column("workers", Integer, nullable=False),
    Column("heartbeat_at", DateTime(timezone=True), nullable=False),
)
