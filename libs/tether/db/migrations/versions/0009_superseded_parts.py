"""superseded parts: each part records the attempt that wrote it, and when a later attempt took
its place

Parts stored before this have no attempt. Of those, the ones a retry is known to have replaced
are marked: tool calls stored cut (the earlier form of the same rule) and unfinished parts of
completed runs (a completed run's last attempt finishes every part it streams, so an unfinished
one was cut off by an earlier attempt). Whole parts of a cut-off turn cannot be told apart from
the answer in old rows and stay as they were.

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("run_parts", sa.Column("lease_epoch", sa.BigInteger(), nullable=True))
    op.add_column(
        "run_parts", sa.Column("superseded_at", sa.DateTime(timezone=True), nullable=True)
    )
    op.execute(
        "UPDATE run_parts SET superseded_at = updated_at "
        "WHERE (kind = 'tool_call' AND payload->>'cut' = 'true') "
        "OR (NOT final AND EXISTS (SELECT 1 FROM runs WHERE runs.run_id = run_parts.run_id "
        "AND runs.status = 'completed'))"
    )


def downgrade() -> None:
    # The earlier code knows a superseded tool call only by its cut mark.
    op.execute(
        "UPDATE run_parts SET payload = payload || '{\"cut\": true}'::jsonb, final = true "
        "WHERE kind = 'tool_call' AND superseded_at IS NOT NULL"
    )
    op.drop_column("run_parts", "superseded_at")
    op.drop_column("run_parts", "lease_epoch")
