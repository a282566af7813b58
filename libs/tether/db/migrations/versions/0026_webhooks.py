"""run-event webhooks: webhook_subscriptions and webhook_deliveries (orchestrator),
webhook_secrets (interactions)

A tenant's subscriptions to run events and their delivery log, keyed tenant first; a delivery is
unique per (subscription, run, seq) so a look at the same event twice records it once, and its
id is the webhook-id every try carries. The signing secrets are sealed by interactions in a
table of their own. Expand only: a release before never names these tables.

Revision ID: 0026
Revises: 0025
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None


def _now(name: str) -> sa.Column[object]:
    return sa.Column(name, sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False)


def upgrade() -> None:
    op.create_table(
        "webhook_subscriptions",
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("subscription_id", sa.Text(), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("events", postgresql.ARRAY(sa.Text()), nullable=False),
        sa.Column("created_by", sa.Text(), nullable=False),
        _now("created_at"),
        sa.Column("disabled_at", sa.DateTime(timezone=True)),
        sa.Column("failing_since", sa.DateTime(timezone=True)),
        _now("scanned_until"),
        sa.PrimaryKeyConstraint("tenant_id", "subscription_id", name="pk_webhook_subscriptions"),
    )
    op.create_table(
        "webhook_deliveries",
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("delivery_id", sa.Text(), nullable=False),
        sa.Column("subscription_id", sa.Text(), nullable=False),
        sa.Column("run_id", sa.Text(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("event_type", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), server_default=sa.text("'pending'"), nullable=False),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), server_default=sa.func.now()),
        sa.Column("first_attempt_at", sa.DateTime(timezone=True)),
        sa.Column("last_http_status", sa.Integer()),
        sa.Column("last_error", sa.Text()),
        sa.Column("sent_at", sa.DateTime(timezone=True)),
        _now("created_at"),
        sa.PrimaryKeyConstraint("tenant_id", "delivery_id", name="pk_webhook_deliveries"),
        sa.UniqueConstraint(
            "tenant_id",
            "subscription_id",
            "run_id",
            "seq",
            name="uq_webhook_deliveries_tenant_id_subscription_id_run_id_seq",
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id", "subscription_id"],
            ["webhook_subscriptions.tenant_id", "webhook_subscriptions.subscription_id"],
            name="fk_webhook_deliveries_tenant_id_webhook_subscriptions",
            ondelete="CASCADE",
        ),
        sa.CheckConstraint(
            "status IN ('pending', 'sent', 'failed')", name="ck_webhook_deliveries_status"
        ),
    )
    op.create_index(
        "ix_webhook_deliveries_due",
        "webhook_deliveries",
        ["next_attempt_at"],
        postgresql_where=sa.text("status = 'pending'"),
    )
    op.create_index(
        "ix_webhook_deliveries_log",
        "webhook_deliveries",
        ["tenant_id", "subscription_id", sa.text("created_at DESC")],
    )
    op.create_table(
        "webhook_secrets",
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("subscription_id", sa.Text(), nullable=False),
        sa.Column("ciphertext", sa.LargeBinary(), nullable=False),
        sa.Column("nonce", sa.LargeBinary(), nullable=False),
        sa.Column("key_id", sa.Text(), nullable=False),
        _now("created_at"),
        sa.PrimaryKeyConstraint("tenant_id", "subscription_id", name="pk_webhook_secrets"),
    )


def downgrade() -> None:
    op.drop_table("webhook_secrets")
    op.drop_table("webhook_deliveries")
    op.drop_table("webhook_subscriptions")
