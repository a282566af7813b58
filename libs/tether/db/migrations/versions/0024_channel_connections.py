"""channel_connections: a tenant's Slack, WhatsApp and generic webhook connections

Owned by interactions. Keyed by (tenant_id, channel_id), tenant first, with channel_id unique on
its own (a provider's webhook names the connection by id alone) and the name unique per tenant.
Every secret is sealed in one AES-GCM object (the secret store's keys); a rotation keeps the
previous verification secret sealed beside it until `previous_expires_at`. Expand only: a
release before never names the table.

Revision ID: 0024
Revises: 0023
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "channel_connections",
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("channel_id", sa.Text(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("agent", sa.Text()),
        sa.Column("api_base_url", sa.Text()),
        sa.Column("reply_url", sa.Text()),
        sa.Column(
            "settings",
            postgresql.JSONB(),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("ciphertext", sa.LargeBinary(), nullable=False),
        sa.Column("nonce", sa.LargeBinary(), nullable=False),
        sa.Column("key_id", sa.Text(), nullable=False),
        sa.Column("secret_hints", postgresql.JSONB(), nullable=False),
        sa.Column("previous_ciphertext", sa.LargeBinary()),
        sa.Column("previous_nonce", sa.LargeBinary()),
        sa.Column("previous_key_id", sa.Text()),
        sa.Column("previous_expires_at", sa.DateTime(timezone=True)),
        sa.Column("created_by", sa.Text(), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.PrimaryKeyConstraint("tenant_id", "channel_id"),
        sa.CheckConstraint(
            "kind IN ('slack', 'whatsapp', 'webhook')", name="channel_connections_kind"
        ),
    )
    op.create_index(
        "channel_connections_channel_id", "channel_connections", ["channel_id"], unique=True
    )
    op.create_index(
        "channel_connections_name", "channel_connections", ["tenant_id", "name"], unique=True
    )


def downgrade() -> None:
    op.drop_table("channel_connections")
