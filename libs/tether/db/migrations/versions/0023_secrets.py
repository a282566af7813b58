"""secrets: a tenant's named secrets, sealed; connections' OAuth tokens sealed beside the old column

The secret store of the interactions service: AES-GCM ciphertext, its nonce and the id of the key
that sealed it (keys rotate), and the value's last four characters for display. Keyed by
(tenant_id, name), tenant first.

`connections` gains three nullable columns holding the access token sealed. The migration cannot
seal the existing plaintext tokens (only the interactions service holds TETHER_SECRETS_KEY):
interactions seals and clears (to '') every plaintext token at startup and any it meets when
reading. Expand only: a release before never names `secrets` nor the new columns and keeps
reading `access_token`; a connection the new release stores has '' there, which the previous
release would hand to a tool as an empty token (the provider refuses it, as a revoked token), so
finish a rollout of interactions before people connect accounts. 0.3.0 drops `access_token`.

Revision ID: 0023
Revises: 0022
"""

import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "secrets",
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("ciphertext", sa.LargeBinary(), nullable=False),
        sa.Column("nonce", sa.LargeBinary(), nullable=False),
        sa.Column("key_id", sa.Text(), nullable=False),
        sa.Column("last_four", sa.Text(), nullable=False),
        sa.Column("created_by", sa.Text(), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.PrimaryKeyConstraint("tenant_id", "name"),
    )
    op.add_column("connections", sa.Column("token_ciphertext", sa.LargeBinary()))
    op.add_column("connections", sa.Column("token_nonce", sa.LargeBinary()))
    op.add_column("connections", sa.Column("token_key_id", sa.Text()))


def downgrade() -> None:
    op.drop_column("connections", "token_key_id")
    op.drop_column("connections", "token_nonce")
    op.drop_column("connections", "token_ciphertext")
    op.drop_table("secrets")
