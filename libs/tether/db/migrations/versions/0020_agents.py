"""agents: a tenant's agents become named, versioned resources

Each tenant's agent was the JSON in `tenants.agent` (with the approval policy's
`always_allow_scopes` in `tenants.policy`), set by nothing but SQL. Agents are now documents
(tether.agent_spec) with immutable numbered versions, one published (`agents`,
`agent_versions`), and per tenant a default agent and a revision the claim compares its cached
routes with (`agent_sets`). Each existing tenant's `tenants.agent` becomes version 1 of its
default agent, named `default`.

Expand only: `tenants.agent` stays, and the release before keeps routing with it during the
rollout (its orchestrators never read the new tables). A tenant created after this migration has
no agents until one is applied, and runs with `tenants.agent` meanwhile. The conversion is
written here, not imported, so that it stays what it was when this migration ran.

Revision ID: 0020
Revises: 0019
"""

import hashlib
import json
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

# What a migrated version names as its author in `agent_versions.created_by`.
MIGRATION_ACTOR = {"migration": "0020"}
# `tenants.agent` keys copied under the same name into the document.
SAME_KEYS = ("model", "persona", "personas", "skills", "context", "prices")


def document(agent: dict[str, Any], policy: dict[str, Any]) -> dict[str, Any]:
    """The `default` agent's document for a tenant whose agent was `agent` and approval policy
    `policy` (as tether.agent_spec.from_overrides made it when this migration was written)."""
    doc: dict[str, Any] = {"name": "default"}
    for key in SAME_KEYS:
        if key in agent:
            doc[key] = agent[key]
    if "system_prompt" in agent and "persona" not in agent:
        doc["instructions"] = agent["system_prompt"]
    if "tool_allowlist" in agent:
        doc["tools"] = agent["tool_allowlist"]
    limits = dict(agent.get("limits", {}))
    if "max_cost_micros" in limits:
        # Whole millionths of a dollar: six decimals are exact.
        limits["max_cost_usd"] = float(Decimal(int(limits.pop("max_cost_micros"))) / 1_000_000)
    if limits:
        doc["limits"] = limits
    if "always_allow_scopes" in policy:
        doc["approvals"] = {"always_allow_scopes": policy["always_allow_scopes"]}
    return doc


def upgrade() -> None:
    op.create_table(
        "agents",
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("published_version", sa.Integer(), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.PrimaryKeyConstraint("tenant_id", "name"),
    )
    op.create_table(
        "agent_versions",
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("written", sa.Text(), nullable=False),
        sa.Column("normalised", JSONB(), nullable=False),
        sa.Column("digest", sa.Text(), nullable=False),
        sa.Column("created_by", JSONB(), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.CheckConstraint("version >= 1", name="version"),
        sa.ForeignKeyConstraint(
            ["tenant_id", "name"], ["agents.tenant_id", "agents.name"], ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("tenant_id", "name", "version"),
    )
    op.create_table(
        "agent_sets",
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("revision", sa.BigInteger(), nullable=False),
        sa.Column("default_agent", sa.Text(), nullable=True),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id", "default_agent"],
            ["agents.tenant_id", "agents.name"],
            name="default_agent",
        ),
        sa.PrimaryKeyConstraint("tenant_id"),
    )
    conn = op.get_bind()
    tenants = conn.execute(sa.text("SELECT tenant_id, agent, policy FROM tenants")).all()
    for tenant_id, agent, policy in tenants:
        doc = document(dict(agent or {}), dict(policy or {}))
        written = json.dumps(doc, indent=2)
        digest = hashlib.sha256(
            json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        ).hexdigest()
        conn.execute(
            sa.text(
                "INSERT INTO agents (tenant_id, name, published_version) VALUES (:t, 'default', 1)"
            ),
            {"t": tenant_id},
        )
        conn.execute(
            sa.text(
                "INSERT INTO agent_versions (tenant_id, name, version, written, normalised,"
                " digest, created_by) VALUES (:t, 'default', 1, :w, CAST(:n AS jsonb), :d,"
                " CAST(:by AS jsonb))"
            ),
            {
                "t": tenant_id,
                "w": written,
                "n": json.dumps(doc),
                "d": digest,
                "by": json.dumps(MIGRATION_ACTOR),
            },
        )
        conn.execute(
            sa.text(
                "INSERT INTO agent_sets (tenant_id, revision, default_agent)"
                " VALUES (:t, 1, 'default')"
            ),
            {"t": tenant_id},
        )


def downgrade() -> None:
    # tenants.agent was never changed: the release before routes with it as it did.
    op.drop_table("agent_sets")
    op.drop_table("agent_versions")
    op.drop_table("agents")
