"""tool_catalog: the tools workers announce, which an agent's document may name

Workers announce their tools (name, input schema digest, risk category, whether they write
externally) in the Work stream's hello; the orchestrator keeps one row per tool name, and an
agent naming a tool that no worker announced is refused. Deployment-wide (no tenant column):
every tenant's agents run on the same workers.

Expand only: a release before never reads or writes the table, and its workers' hellos announce
nothing (the catalog then fills as the new workers connect).

Revision ID: 0022
Revises: 0021
"""

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tool_catalog",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("schema_sha256", sa.Text(), nullable=False),
        sa.Column("risk", sa.Text(), nullable=False),
        sa.Column("writes_externally", sa.Boolean(), nullable=False),
        sa.Column("announced_by", sa.Text(), nullable=False),
        sa.Column(
            "announced_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.PrimaryKeyConstraint("name"),
    )


def downgrade() -> None:
    op.drop_table("tool_catalog")
