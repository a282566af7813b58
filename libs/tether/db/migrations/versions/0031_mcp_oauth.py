"""MCP OAuth connections: what a consent offer for an `auth: oauth` MCP server keeps until its
callback (the discovered token endpoint, the client id, the PKCE code verifier sealed), and what
a connection keeps to refresh itself (the token endpoint, the client id, the refresh token
sealed). Expand only: nullable columns a release before never names.

Revision ID: 0031
Revises: 0030
"""

import sqlalchemy as sa
from alembic import op

revision = "0031"
down_revision = "0030"
branch_labels = None
depends_on = None

_OAUTH = (
    ("oauth_token_endpoint", sa.Text()),
    ("oauth_client_id", sa.Text()),
)


def upgrade() -> None:
    for name, kind in _OAUTH:
        op.add_column("interactions", sa.Column(name, kind, nullable=True))
        op.add_column("connections", sa.Column(name, kind, nullable=True))
    for column in ("ciphertext", "nonce"):
        op.add_column("interactions", sa.Column(f"verifier_{column}", sa.LargeBinary()))
        op.add_column("connections", sa.Column(f"refresh_{column}", sa.LargeBinary()))
    op.add_column("interactions", sa.Column("verifier_key_id", sa.Text()))
    op.add_column("connections", sa.Column("refresh_key_id", sa.Text()))


def downgrade() -> None:
    for name, _ in _OAUTH:
        op.drop_column("interactions", name)
        op.drop_column("connections", name)
    for column in ("ciphertext", "nonce", "key_id"):
        op.drop_column("interactions", f"verifier_{column}")
        op.drop_column("connections", f"refresh_{column}")
