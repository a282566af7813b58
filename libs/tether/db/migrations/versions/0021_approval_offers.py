"""interactions: an approval records what its run's agent's approval policy offers on it

The approval policy moved from `tenants.policy` into the agent document (0020). Interactions
reads no orchestrator table: the worker sends the run's policy with the approval, and the
approval keeps the decisions it offers and the scopes allow-always may grant. Both columns are
nullable and NULL means "the tenant's policy decides", which is what an approval stored by the
release before (or for a run routed by `tenants.agent`) gets: expand only; the release before
keeps writing approvals without them during the rollout.

Revision ID: 0021
Revises: 0020
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import ARRAY

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("interactions", sa.Column("offered_decisions", ARRAY(sa.Text())))
    op.add_column("interactions", sa.Column("always_allow_scopes", ARRAY(sa.Text())))


def downgrade() -> None:
    op.drop_column("interactions", "always_allow_scopes")
    op.drop_column("interactions", "offered_decisions")
