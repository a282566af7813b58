"""messages.channel_origin: where a channel connection's message came from and its answer goes

Written by admission for a message a verified channel connection delivered (the connection, the
provider's address, thread and message answered, the agent the connection routes to), read by
the orchestrator's claim into the attempt's context. Its JSON records its format (`v`). NULL for
every other message. Expand only: a release before never names the column.

Revision ID: 0025
Revises: 0024
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("messages", sa.Column("channel_origin", postgresql.JSONB(), nullable=True))


def downgrade() -> None:
    op.drop_column("messages", "channel_origin")
