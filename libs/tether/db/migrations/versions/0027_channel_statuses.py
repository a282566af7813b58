"""channel_statuses: WhatsApp's status callbacks, recorded against the delivery they report on

PLACEHOLDER of the gateway helper's migration of the same name and shape (issue 30), so that the
delivery branch can read the table before that branch merges; the integrator keeps that one.
`callback_data` is the `biz_opaque_callback_data` a delivery was sent with (its delivery id).

Revision ID: 0027
Revises: 0025
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0027"
down_revision = "0025"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "channel_statuses",
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("channel_id", sa.Text(), nullable=False),
        sa.Column("provider_message_id", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("callback_data", sa.Text(), nullable=True),
        sa.Column("errors", postgresql.JSONB(), nullable=True),
        sa.Column("reported_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column(
            "recorded_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        sa.PrimaryKeyConstraint(
            "tenant_id",
            "channel_id",
            "provider_message_id",
            "status",
            name=op.f("pk_channel_statuses"),
        ),
    )
    op.create_index(
        "ix_channel_statuses_callback", "channel_statuses", ["tenant_id", "callback_data"]
    )


def downgrade() -> None:
    op.drop_table("channel_statuses")
