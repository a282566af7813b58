"""runs: drop ix_runs_queued, which no statement uses

The claim searches `ix_runs_claimable` (queued session heads) and a finishing head finds its
session's next message through `ix_runs_session_queued`; nothing reads queued runs by arrival
alone any more (the session heads of 0004 replaced that search). Every admitted run still paid
an entry in it (about 140 bytes of WAL per run, with the claim's move out of it). Dropping an
index is safe beside the release before: no statement names it.

Revision ID: 0013
Revises: 0012
"""

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("ix_runs_queued", table_name="runs")


def downgrade() -> None:
    op.execute("CREATE INDEX ix_runs_queued ON runs (created_at) WHERE status = 'queued'")
