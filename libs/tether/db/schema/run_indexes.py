"""The indexes of `runs`: the claim's scans and probes (its fair slots, capped tenants and held
agents), and the wakers' (the reaper, retries, timers, parents waiting for children). Each is a
partial index where the state it serves is, so a search by state goes through `in_state`; every
index of `runs` is one more entry per non-HOT update of a run's row (issue 34's WAL), so one is
added here only for a read that needs it. And `run_keys`, where the reads by tenant, owner,
session and message find a run off its row (migrations 0046 and 0047), with its indexes; it
holds the references of a run to its session and its message, which those indexes serve when
one is removed."""

from __future__ import annotations

from sqlalchemy import (
    Column,
    DateTime,
    ForeignKey,
    FromClause,
    Index,
    Join,
    PrimaryKeyConstraint,
    Table,
    Text,
    and_,
)

from tether.db.schema.base import metadata
from tether.db.schema.orchestrator_tables import runs

# A run's lookup keys, one row a run, written once (a trigger on `runs` adds and removes them,
# migration 0046) and never updated: the reads of runs by tenant, owner, session and message
# find them here, off the row whose two non-HOT updates would add an entry to each of their
# indexes again (issue 34). Its primary key and its indexes (below) are those lookups, and serve
# its foreign keys (0047 moved them from runs): removing a session or a message checks here that
# no run names it.
run_keys = Table(
    "run_keys",
    metadata,
    Column("tenant_id", Text, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("run_id", Text, nullable=False),
    Column("owner_principal_id", Text),
    Column("session_id", Text, ForeignKey("sessions.session_id"), nullable=False),
    Column("message_id", Text, ForeignKey("messages.message_id"), nullable=False),
    PrimaryKeyConstraint("tenant_id", "created_at", "run_id"),
)


def keyed_runs(run: FromClause = runs, keys: FromClause = run_keys) -> Join:
    """`keys` joined to the runs they name (aliases of `runs` and `run_keys`, or the tables):
    a read by a lookup key finds the keys in `run_keys`' indexes, then each run by its primary
    key. Joined on the whole key, so that a read that finds its runs another way (a tree's, by
    `ix_runs_tree_root`) finds each one's keys by their primary key too."""
    return keys.join(
        run,
        and_(
            run.c.run_id == keys.c.run_id,
            run.c.tenant_id == keys.c.tenant_id,
            run.c.created_at == keys.c.created_at,
        ),
    )


# The claim's slots: claimable runs in start-tag order (whose turn it is, across tenants).
Index(
    "ix_runs_fair",
    runs.c.fair_key,
    runs.c.run_id,
    postgresql_where=(runs.c.status == "queued")
    & runs.c.session_head
    & ~runs.c.capped
    & runs.c.held_agent.is_(None),
)
# A capped tenant's claimable runs in start-tag order: the claim's probe of its room.
Index(
    "ix_runs_capped",
    runs.c.tenant_id,
    runs.c.fair_key,
    runs.c.run_id,
    postgresql_where=(runs.c.status == "queued")
    & runs.c.session_head
    & runs.c.capped
    & runs.c.held_agent.is_(None),
)
# The claim's pick for a tenant's slot: its claimable runs by priority, then start tag.
Index(
    "ix_runs_tenant_claimable",
    runs.c.tenant_id,
    runs.c.priority,
    runs.c.fair_key,
    runs.c.run_id,
    postgresql_where=(runs.c.status == "queued")
    & runs.c.session_head
    & runs.c.held_agent.is_(None),
)
# A held agent's claimable runs (`held_agent`) by priority, then start tag: the claim's probe of
# its room.
Index(
    "ix_runs_agent_held",
    runs.c.tenant_id,
    runs.c.held_agent,
    runs.c.priority,
    runs.c.fair_key,
    runs.c.run_id,
    postgresql_where=(runs.c.status == "queued")
    & runs.c.session_head
    & runs.c.held_agent.is_not(None),
)
# The held runs' start tags: the queue's virtual time counts them (`fair_tags`).
Index(
    "ix_runs_held_tags",
    runs.c.fair_key,
    runs.c.run_id,
    postgresql_where=(runs.c.status == "queued")
    & runs.c.session_head
    & ~runs.c.capped
    & runs.c.held_agent.is_not(None),
)
# Finding a session's next message when its head finishes.
Index(
    "ix_runs_session_queued",
    runs.c.session_id,
    runs.c.created_at,
    runs.c.run_id,
    postgresql_where=runs.c.status == "queued",
)
# The running runs, oldest first, for the reaper: keyed by what never changes while a run runs,
# so a lease's renewal and a checkpoint (which move lease_expires_at, last_seq and
# checkpoint_batch) change no indexed column and are HOT updates, given room on the page
# (RUNS_FILLFACTOR): a new row version on the same page and no new index entries, instead of
# one in every index of the table.
Index("ix_runs_running", runs.c.started_at, postgresql_where=runs.c.status == "running")
# Retention: a tenant's finished runs oldest first; the runs that retried a run (only retried
# runs have a parent).
Index(
    "ix_runs_tenant_finished",
    runs.c.tenant_id,
    runs.c.finished_at,
    runs.c.run_id,
    postgresql_where=runs.c.finished_at.is_not(None),
)
Index("ix_runs_parent", runs.c.parent_run_id, postgresql_where=runs.c.parent_run_id.is_not(None))
Index(
    "ix_runs_retry_due",
    runs.c.next_attempt_at,
    postgresql_where=runs.c.status == "retry-pending",
)
# A delegate call starts one child, however often its parent's attempts issue it; a parent's
# children (the tree below a run, cancels and budgets).
Index(
    "ux_runs_tree_call",
    runs.c.tree_parent_run_id,
    runs.c.tree_call_id,
    unique=True,
    postgresql_where=runs.c.tree_parent_run_id.is_not(None),
)
# A tree's runs below its root (ListRuns of a tree, `tether run --tree`).
Index(
    "ix_runs_tree_root",
    runs.c.tree_root_run_id,
    postgresql_where=runs.c.tree_root_run_id.is_not(None),
)
# The children's waker: parents waiting for their children.
Index(
    "ix_runs_children_waiting",
    runs.c.updated_at,
    postgresql_where=runs.c.status == "waiting-for-children",
)
# The timers' waker: parked timers, soonest due first.
Index(
    "ix_runs_timer_due",
    runs.c.next_wake_at,
    postgresql_where=runs.c.status == "waiting-for-timer",
)

# The lookups by key, on `run_keys` (its primary key is the tenant's runs by created_at): a
# principal's runs, a session's, a message's.
Index(
    "ix_run_keys_tenant_id_owner_principal_id_created_at_run_id",
    run_keys.c.tenant_id,
    run_keys.c.owner_principal_id,
    run_keys.c.created_at,
    run_keys.c.run_id,
)
Index("ix_run_keys_session_id_created_at", run_keys.c.session_id, run_keys.c.created_at)
Index("ix_run_keys_message_id", run_keys.c.message_id)
