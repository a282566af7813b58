"""context: knowledge documents, and the summaries that stand in for earlier runs

`documents` holds what a tenant uploads for its runs' context, searched by PostgreSQL full-text
search (a generated tsvector with a GIN index). `context_summaries` points at the summary part
that stands in for a session's earlier runs once its history was compacted, one per range; it
goes with the run that holds it (retention, a tenant's deletion). Expand only: both are new
tables.

Revision ID: 0015
Revises: 0014
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "documents",
        sa.Column("document_id", sa.Text(), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("title", sa.Text(), nullable=False),
        sa.Column("content", sa.Text(), nullable=False),
        sa.Column("created_by", sa.Text(), nullable=False),
        sa.Column(
            "search",
            postgresql.TSVECTOR(),
            sa.Computed(
                "to_tsvector('english'::regconfig, title || ' ' || content)", persisted=True
            ),
            nullable=False,
        ),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.PrimaryKeyConstraint("document_id", name=op.f("pk_documents")),
    )
    op.create_index(
        "ix_documents_tenant_created",
        "documents",
        ["tenant_id", sa.text("created_at DESC"), sa.text("document_id DESC")],
    )
    op.create_index("ix_documents_search", "documents", ["search"], postgresql_using="gin")
    op.create_table(
        "context_summaries",
        sa.Column("session_id", sa.Text(), nullable=False),
        sa.Column("through_run_id", sa.Text(), nullable=False),
        sa.Column("through_created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("run_id", sa.Text(), nullable=False),
        sa.Column("part_index", sa.Integer(), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.ForeignKeyConstraint(
            ["run_id", "part_index"],
            ["run_parts.run_id", "run_parts.part_index"],
            name=op.f("fk_context_summaries_run_id_run_parts"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("session_id", "through_run_id", name=op.f("pk_context_summaries")),
    )
    op.create_index(
        "ix_context_summaries_latest",
        "context_summaries",
        ["session_id", sa.text("through_created_at DESC")],
    )


def downgrade() -> None:
    op.drop_index("ix_context_summaries_latest", table_name="context_summaries")
    op.drop_table("context_summaries")
    op.drop_index("ix_documents_search", table_name="documents")
    op.drop_index("ix_documents_tenant_created", table_name="documents")
    op.drop_table("documents")
