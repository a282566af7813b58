"""tenant_stripes: a tenant's finish tag striped over 16 rows, so its admissions do not wait

Admission moved the tenant's one finish tag (`tenant_queues.tail`) on in an upsert, which
held the tenant's row until the admitting statement committed: one tenant's admissions queued
for each other, one commit at a time. Now the tag is striped over 16 rows per tenant
(`tenant_stripes`); stripe s hands out the tenant's tags s, s + 16, s + 32, ... (in steps of
1 / weight), and an admission takes the free stripe with the least next tag
(`FOR UPDATE SKIP LOCKED`), so the tenant's tags stay in admission order within the admissions
in flight.

Each tenant with a finish tag gets its 16 stripes here, going on from it: stripe s's next tag is
the tail plus s / weight. Expand only: `tenant_queues` stays (a claim locks a capped tenant's row
there, as the release before does); a release before keeps moving its tail on while the two run
side by side, and its runs and this one's take tags from their own rows until it is gone.

Revision ID: 0036
Revises: 0035
"""

import sqlalchemy as sa
from alembic import op

revision = "0036"
down_revision = "0035"
branch_labels = None
depends_on = None

# services.orchestrator.repositories.intake.STRIPES, as it was when this ran.
STRIPES = 16


def upgrade() -> None:
    op.create_table(
        "tenant_stripes",
        sa.Column(
            "tenant_id",
            sa.Text(),
            sa.ForeignKey("tenants.tenant_id", name=op.f("fk_tenant_stripes_tenant_id_tenants")),
            nullable=False,
        ),
        sa.Column("stripe", sa.SmallInteger(), nullable=False),
        sa.Column("tail", sa.Float(precision=53), server_default="0", nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "stripe", name=op.f("pk_tenant_stripes")),
    )
    op.create_index("ix_tenant_stripes_tail", "tenant_stripes", ["tail"])
    op.execute(
        "INSERT INTO tenant_stripes (tenant_id, stripe, tail)"
        " SELECT q.tenant_id, s, q.tail + s::double precision / t.weight"
        " FROM tenant_queues q JOIN tenants t ON t.tenant_id = q.tenant_id"
        f" CROSS JOIN generate_series(0, {STRIPES - 1}) AS s"
    )


def downgrade() -> None:
    op.drop_index("ix_tenant_stripes_tail", table_name="tenant_stripes")
    op.drop_table("tenant_stripes")
