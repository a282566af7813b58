"""stored formats: every stored payload records the format it was written in

Rows stored before this carry format 1 (the column's default, also what a release that does not
know the column writes during a rolling deploy); this release writes format 2 and reads both
(`tether.formats`).

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

TABLES = ("runs", "run_parts", "run_events", "interactions")


def upgrade() -> None:
    for table in TABLES:
        # A constant default: PostgreSQL adds the column without rewriting the table.
        op.add_column(
            table,
            sa.Column("format", sa.SmallInteger(), nullable=False, server_default=sa.text("1")),
        )


def downgrade() -> None:
    for table in TABLES:
        op.drop_column(table, "format")
