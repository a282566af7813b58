"""channel_statuses: what channel providers report about messages sent through a connection

Owned by the orchestrator, written through RecordChannelStatuses from the gateway's verified
WhatsApp webhooks (status callbacks: sent, delivered, read, failed), one row per message and
status (a status reported again is the same row). A delivery finds its own message by
`callback_data` (the biz_opaque_callback_data it sent). Expand only: a release before never
names the table.

Revision ID: 0027
Revises: 0026
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0027"
down_revision = "0026"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "channel_statuses",
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("channel_id", sa.Text(), nullable=False),
        sa.Column("provider_message_id", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("callback_data", sa.Text()),
        sa.Column("errors", postgresql.JSONB()),
        sa.Column("reported_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column(
            "recorded_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.PrimaryKeyConstraint(
            "tenant_id",
            "channel_id",
            "provider_message_id",
            "status",
        ),
    )
    op.create_index(
        "ix_channel_statuses_tenant_id_callback_data",
        "channel_statuses",
        ["tenant_id", "callback_data"],
    )


def downgrade() -> None:
    op.drop_table("channel_statuses")
