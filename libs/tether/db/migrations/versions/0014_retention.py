"""retention: what removing expired runs, messages and sessions needs, and claims as tombstones

Removing a run must find what names it without scanning: its claim (`ix_event_claims_run`), its
effects and tool outputs, the runs that retried it (`ix_runs_parent`); removing a message, the
runs that name it (`ix_runs_message`); removing a session, its messages (`ix_messages_session`).
The sweeps walk a tenant's finished runs and messages oldest first (`ix_runs_tenant_finished`,
`ix_messages_tenant_created`) and its tombstones (`ix_event_claims_tombstones`).

A removed run's claim stays as the event's tombstone: `event_claims.run_id` becomes nullable and
its foreign key SET NULL, so the run's removal and the tombstone are one statement. An
interaction goes with its run (CASCADE); a standing grant it minted stays, no longer naming it
(SET NULL). Each constraint is added NOT VALID, then validated, so no write waits on a scan.

Expand only: the release before never removes a run, and reads a tombstone (a claim without a
run) as an absent run (NOT_FOUND) should it meet one during the rollout.

Revision ID: 0014
Revises: 0013
"""

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

# (table, constraint, column, referred, its action now, what it was)
_FOREIGN_KEYS = (
    (
        "event_claims",
        "fk_event_claims_run_id_runs",
        "run_id",
        "runs(run_id)",
        "ON DELETE SET NULL DEFERRABLE INITIALLY DEFERRED",
        "DEFERRABLE INITIALLY DEFERRED",
    ),
    (
        "interactions",
        "fk_interactions_run_id_runs",
        "run_id",
        "runs(run_id)",
        "ON DELETE CASCADE",
        "",
    ),
    (
        "grants",
        "fk_grants_interaction_id_interactions",
        "interaction_id",
        "interactions(interaction_id)",
        "ON DELETE SET NULL",
        "",
    ),
)

_INDEXES = (
    ("ix_event_claims_run", "event_claims", "(run_id)", ""),
    ("ix_event_claims_tombstones", "event_claims", "(tenant_id, claimed_at)", "run_id IS NULL"),
    (
        "ix_runs_tenant_finished",
        "runs",
        "(tenant_id, finished_at, run_id)",
        "finished_at IS NOT NULL",
    ),
    ("ix_runs_message", "runs", "(message_id)", ""),
    ("ix_runs_parent", "runs", "(parent_run_id)", "parent_run_id IS NOT NULL"),
    ("ix_messages_tenant_created", "messages", "(tenant_id, created_at, message_id)", ""),
    ("ix_messages_session", "messages", "(session_id)", ""),
    ("ix_effects_run", "effects", "(run_id)", ""),
    ("ix_tool_outputs_run", "tool_outputs", "(run_id)", ""),
    ("ix_grants_interaction", "grants", "(interaction_id)", "interaction_id IS NOT NULL"),
)


def _replace_foreign_key(table: str, name: str, column: str, referred: str, action: str) -> None:
    op.execute(f"ALTER TABLE {table} DROP CONSTRAINT {name}")
    op.execute(
        f"ALTER TABLE {table} ADD CONSTRAINT {name} FOREIGN KEY ({column}) "
        f"REFERENCES {referred} {action} NOT VALID"
    )
    op.execute(f"ALTER TABLE {table} VALIDATE CONSTRAINT {name}")


def upgrade() -> None:
    for name, table, columns, where in _INDEXES:
        predicate = f" WHERE {where}" if where else ""
        op.execute(f"CREATE INDEX IF NOT EXISTS {name} ON {table} {columns}{predicate}")
    op.alter_column("event_claims", "run_id", nullable=True)
    for table, name, column, referred, action, _ in _FOREIGN_KEYS:
        _replace_foreign_key(table, name, column, referred, action)


def downgrade() -> None:
    op.execute("DELETE FROM event_claims WHERE run_id IS NULL")
    for table, name, column, referred, _, before in _FOREIGN_KEYS:
        _replace_foreign_key(table, name, column, referred, before)
    op.alter_column("event_claims", "run_id", nullable=False)
    for name, _, _, _ in _INDEXES:
        op.execute(f"DROP INDEX IF EXISTS {name}")
