"""deliveries: a channel run's answer going out, recorded before it is sent

Owned by the orchestrator, written only by a worker's fenced BeginDelivery/FinishDelivery: one
row per run (`delivery_id` derived from the tenant, the run and "answer"), so every attempt of
the run finds the same one and asks the provider before it posts again. Expand only: a release
before never names the table.

Revision ID: 0028
Revises: 0027
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0028"
down_revision = "0027"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "deliveries",
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("delivery_id", sa.Text(), nullable=False),
        sa.Column("run_id", sa.Text(), nullable=False),
        sa.Column("channel_id", sa.Text(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("provider_message_id", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("error", postgresql.JSONB(), nullable=True),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.run_id"], name=op.f("fk_deliveries_run_id_runs")
        ),
        sa.PrimaryKeyConstraint("tenant_id", "delivery_id", name=op.f("pk_deliveries")),
        sa.CheckConstraint(
            "state IN ('pending', 'awaiting-approval', 'sent', 'failed', 'unknown', 'denied')",
            name=op.f("ck_deliveries_state"),
        ),
    )
    op.create_index("ix_deliveries_run", "deliveries", ["run_id"])


def downgrade() -> None:
    op.drop_table("deliveries")
