"""browser credentials: console sessions and embedding apps' short-lived tokens

`browser_credentials` is the gateway's: a session cookie's or a token's SHA-256, the API key it
was minted from (its tenant, principal and a subset of its scopes), and its expiry. It goes
with its key (ON DELETE CASCADE: a deleted tenant's keys take theirs along); a revoked key's are
refused by the lookup, which joins the key. Expand only: a new table.

Revision ID: 0016
Revises: 0015
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "browser_credentials",
        sa.Column("credential_id", sa.Text(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("secret_hash", sa.LargeBinary(), nullable=False),
        sa.Column("key_id", sa.Text(), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("principal_id", sa.Text(), nullable=False),
        sa.Column("scopes", postgresql.ARRAY(sa.Text()), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "kind IN ('session', 'token')", name=op.f("ck_browser_credentials_kind")
        ),
        sa.ForeignKeyConstraint(
            ["key_id"],
            ["api_keys.key_id"],
            name=op.f("fk_browser_credentials_key_id_api_keys"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("credential_id", name=op.f("pk_browser_credentials")),
        sa.UniqueConstraint("secret_hash", name=op.f("uq_browser_credentials_secret_hash")),
    )
    op.create_index("ix_browser_credentials_key_id", "browser_credentials", ["key_id"])


def downgrade() -> None:
    op.drop_index("ix_browser_credentials_key_id", table_name="browser_credentials")
    op.drop_table("browser_credentials")
