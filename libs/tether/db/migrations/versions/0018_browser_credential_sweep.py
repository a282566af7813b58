"""browser_credentials: an index on expiry for the gateway's sweep

Expired credentials were removed only when their key minted another, so a key that stopped
signing in left its expired sessions and tokens behind for good. The gateway now sweeps them
(`services/gateway/browser_credentials.sweep`), soonest expired first, and sleeps until the next
expiry: both read this index. Expand only: an index.

Revision ID: 0018
Revises: 0017
"""

from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_browser_credentials_expires_at", "browser_credentials", ["expires_at"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_browser_credentials_expires_at", table_name="browser_credentials")
