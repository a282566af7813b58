"""Caps: the capped tenants found without reading every tenant

Every claim leaves out the runs of a capped tenant it did not lock first
(`services.orchestrator.repositories.fair`), reading which tenants have a cap
(`tenants.max_running`): through this index, as many rows as there are capped tenants, whatever
the number of tenants. Expand only.

Revision ID: 0030
Revises: 0029
"""

from alembic import op

revision = "0030"
down_revision = "0029"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "CREATE INDEX ix_tenants_capped ON tenants (tenant_id) WHERE max_running IS NOT NULL"
    )


def downgrade() -> None:
    op.drop_index("ix_tenants_capped", table_name="tenants")
