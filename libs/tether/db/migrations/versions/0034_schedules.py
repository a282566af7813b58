"""schedules: a tenant's recurring runs, owned by admission

Each tick of a schedule's cron admits a run through admission's own path, keyed by (schedule,
tick time). Keyed tenant first; the tickers find what is due through a partial index on the next
fire time of the schedules not paused. Expand only: a release before never names the table.

Revision ID: 0034
Revises: 0033
"""

import sqlalchemy as sa
from alembic import op

revision = "0034"
down_revision = "0033"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "schedules",
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("schedule_id", sa.Text(), nullable=False),
        sa.Column("principal_id", sa.Text(), nullable=False),
        sa.Column("agent", sa.Text(), nullable=False),
        sa.Column("cron", sa.Text(), nullable=False),
        sa.Column("timezone", sa.Text(), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("overlap", sa.Text(), nullable=False),
        sa.Column("catch_up", sa.Text(), nullable=False),
        sa.Column("catch_up_window_s", sa.Integer(), nullable=False),
        sa.Column("next_fire_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("paused_at", sa.DateTime(timezone=True)),
        sa.Column("last_tick_at", sa.DateTime(timezone=True)),
        sa.Column("last_run_id", sa.Text()),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.PrimaryKeyConstraint("tenant_id", "schedule_id", name="pk_schedules"),
        sa.CheckConstraint("overlap IN ('skip', 'allow')", name="ck_schedules_overlap"),
        sa.CheckConstraint("catch_up IN ('latest', 'none', 'all')", name="ck_schedules_catch_up"),
    )
    op.create_index(
        "ix_schedules_due",
        "schedules",
        ["next_fire_at"],
        postgresql_where=sa.text("paused_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_schedules_due", table_name="schedules")
    op.drop_table("schedules")
