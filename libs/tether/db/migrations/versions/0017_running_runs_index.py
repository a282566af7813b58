"""runs: renewals and checkpoints become HOT updates

A running run's row is rewritten by every lease renewal (a worker's keepalive, every quarter of
the lease's lifetime) and every checkpoint, and each version was a non-HOT update: it moved
`lease_expires_at`, which `ix_runs_lease_expiry` indexed, so every index of the table took a new
entry (1,069 bytes of WAL per renewal, `make bench BENCH=hotpath`). The reaper's index is now
keyed by when the run started (`ix_runs_running`, the running runs), and the table keeps room on
each page for new versions (fillfactor 70, for pages written from now on): a renewal or a
checkpoint changes no indexed column, and its new version goes on its own page (112 bytes of WAL
per renewal). The reaper, and the release before, read the same rows through the new index,
filtering the running runs by expiry; their number is bounded by the workers' slots.

Revision ID: 0017
Revises: 0016
"""

from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("CREATE INDEX ix_runs_running ON runs (started_at) WHERE status = 'running'")
    op.drop_index("ix_runs_lease_expiry", table_name="runs")
    op.execute("ALTER TABLE runs SET (fillfactor = 70)")


def downgrade() -> None:
    op.execute("ALTER TABLE runs RESET (fillfactor)")
    op.execute(
        "CREATE INDEX ix_runs_lease_expiry ON runs (lease_expires_at) WHERE status = 'running'"
    )
    op.drop_index("ix_runs_running", table_name="runs")
