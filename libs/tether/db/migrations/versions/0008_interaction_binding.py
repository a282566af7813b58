"""interaction binding: the storing lease, delivery of resolutions, orphans swept with a reason

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

RESOLVED = "status IN ('answered', 'decided', 'completed', 'expired')"


def upgrade() -> None:
    op.add_column("interactions", sa.Column("lease_epoch", sa.BigInteger(), nullable=True))
    op.add_column("interactions", sa.Column("reason", sa.Text(), nullable=True))
    op.add_column(
        "interactions", sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=True)
    )
    op.add_column("interactions", sa.Column("bound_at", sa.DateTime(timezone=True), nullable=True))
    op.drop_constraint(op.f("ck_interactions_status"), "interactions", type_="check")
    op.create_check_constraint(
        op.f("ck_interactions_status"),
        "interactions",
        "status IN ('pending', 'answered', 'decided', 'completed', 'expired', 'claimed', "
        "'orphaned')",
    )
    # Resolutions already stored were delivered, except those whose run still waits on them
    # (the redelivery sweep finishes those, and the orchestrator's guard keeps it once).
    op.execute(
        "UPDATE interactions SET delivered_at = coalesce(resolved_at, now()) "
        "WHERE status <> 'pending' AND NOT EXISTS (SELECT 1 FROM runs "
        "WHERE runs.waiting_interaction_id = interactions.interaction_id "
        "AND runs.status LIKE 'waiting-for-%')"
    )
    op.create_index(
        "ix_interactions_unconfirmed",
        "interactions",
        ["created_at"],
        unique=False,
        postgresql_where=sa.text("status = 'pending' AND bound_at IS NULL"),
    )
    op.create_index(
        "ix_interactions_undelivered",
        "interactions",
        ["resolved_at"],
        unique=False,
        postgresql_where=sa.text(f"{RESOLVED} AND delivered_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_interactions_undelivered", table_name="interactions")
    op.drop_index("ix_interactions_unconfirmed", table_name="interactions")
    op.execute("UPDATE interactions SET status = 'expired' WHERE status = 'orphaned'")
    op.drop_constraint(op.f("ck_interactions_status"), "interactions", type_="check")
    op.create_check_constraint(
        op.f("ck_interactions_status"),
        "interactions",
        "status IN ('pending', 'answered', 'decided', 'completed', 'expired', 'claimed')",
    )
    op.drop_column("interactions", "bound_at")
    op.drop_column("interactions", "delivered_at")
    op.drop_column("interactions", "reason")
    op.drop_column("interactions", "lease_epoch")
