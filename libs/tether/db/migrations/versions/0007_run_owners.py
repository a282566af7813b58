"""run owners and visibility

Every run records the principal of the authenticated key that admitted it, and whether it is
private to that principal (chat) or an integration's (webhooks, task events). Existing runs are
backfilled from their message: chat, decision and task events carried the caller's principal as
their actor; a messaging event's actor was the sender its body named, so its owner stays
unknown (NULL: only runs:all keys see it, and no principal's grant or connection applies).
Principal-scoped grants are rebound to the principal who decided them, the only authenticated
principal they ever had (their principal_id was the run's actor, which a webhook body chose).

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("owner_principal_id", sa.Text(), nullable=True))
    op.add_column(
        "runs",
        sa.Column("visibility", sa.Text(), server_default=sa.text("'private'"), nullable=False),
    )
    op.execute(
        """
        UPDATE runs SET
          owner_principal_id = CASE WHEN m.source IN ('chat', 'decision', 'task')
                                    THEN m.actor_id END,
          visibility = CASE WHEN m.source IN ('chat', 'decision') THEN 'private'
                            ELSE 'tenant' END
        FROM messages m
        WHERE m.message_id = runs.message_id
        """
    )
    # Every insert names both; a default would hide one that forgot.
    op.alter_column("runs", "visibility", server_default=None)
    op.create_check_constraint(
        op.f("ck_runs_visibility"), "runs", "visibility IN ('private', 'tenant')"
    )
    op.create_index(
        "ix_runs_tenant_owner_created",
        "runs",
        [
            "tenant_id",
            "owner_principal_id",
            sa.literal_column("created_at DESC"),
            sa.literal_column("run_id DESC"),
        ],
    )
    op.execute("UPDATE grants SET principal_id = granted_by WHERE scope = 'principal'")


def downgrade() -> None:
    op.drop_index("ix_runs_tenant_owner_created", table_name="runs")
    op.drop_constraint(op.f("ck_runs_visibility"), "runs", type_="check")
    op.drop_column("runs", "visibility")
    op.drop_column("runs", "owner_principal_id")
