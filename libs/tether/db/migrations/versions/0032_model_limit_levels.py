"""model_limit_levels, model_limit_replicas: the model rate-limit buckets' levels and the
replicas sharing them

Owned by the orchestrator, written in batches off the grant's path (at most every
TETHER_ORCHESTRATOR_MODEL_LIMIT_SYNC_S, the levels only while they changed): a replica that
starts refills its buckets from the stored levels, and each replica's share of a limit is its
connected workers over those of the replicas whose heartbeat is recent. Deployment-wide (no
tenant_id): a bucket belongs to a provider credential, not to a tenant. Expand only.

Revision ID: 0032
Revises: 0031
"""

import sqlalchemy as sa
from alembic import op

revision = "0032"
down_revision = "0031"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "model_limit_levels",
        sa.Column("credential", sa.Text(), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("requests", sa.Float(), nullable=True),
        sa.Column("input_tokens", sa.Float(), nullable=True),
        sa.Column("output_tokens", sa.Float(), nullable=True),
        sa.Column("measured_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("replica_id", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("credential", "model", name=op.f("pk_model_limit_levels")),
    )
    op.create_table(
        "model_limit_replicas",
        sa.Column("replica_id", sa.Text(), nullable=False),
        sa.Column("workers", sa.Integer(), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("replica_id", name=op.f("pk_model_limit_replicas")),
    )


def downgrade() -> None:
    op.drop_table("model_limit_replicas")
    op.drop_table("model_limit_levels")
