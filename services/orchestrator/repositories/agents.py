"""Agents: a tenant's agents, their immutable numbered versions, and its agent set (the default
agent and the revision every change bumps). All writes of one tenant's agents take its set's row
lock first (`lock_set`), so two applies, or an apply and a removal, never interleave."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Exists, and_, delete, func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from tether.db.schema import (
    agent_sets,
    agent_versions,
    agents,
    keyed_runs,
    routings,
    run_keys,
    runs,
)
from tether.domain import AGENT_VERSION
from tether.states import RunStatus

# Runs that still run with the routing they were pinned to (or will, once resumed or retried).
UNFINISHED = tuple(s.value for s in RunStatus if not s.terminal)


@dataclass(frozen=True, slots=True)
class AgentSet:
    """A tenant's agent set as locked: its revision and its default agent (None: no default)."""

    revision: int
    default_agent: str | None


@dataclass(frozen=True, slots=True)
class Version:
    """One version of an agent."""

    name: str
    version: int
    written: str
    normalised: Mapping[str, Any]
    digest: str
    created_by: Mapping[str, Any]
    created_at: datetime


@dataclass(frozen=True, slots=True)
class Published:
    """An agent with its published version."""

    name: str
    published_version: int
    updated_at: datetime


async def lock_set(conn: AsyncConnection, tenant_id: str) -> AgentSet:
    """The tenant's agent set, made (revision 0, no default) if it has none, locked until the
    transaction ends."""
    await conn.execute(
        pg_insert(agent_sets)
        .values(tenant_id=tenant_id, revision=0)
        .on_conflict_do_nothing(index_elements=["tenant_id"])
    )
    row = (
        await conn.execute(
            select(agent_sets.c.revision, agent_sets.c.default_agent)
            .where(agent_sets.c.tenant_id == tenant_id)
            .with_for_update()
        )
    ).one()
    return AgentSet(int(row.revision), row.default_agent)


async def bump(conn: AsyncConnection, tenant_id: str, *, default_agent: str | None) -> int:
    """Bump the tenant's revision (its cached routes go stale) and set its default agent; the
    new revision."""
    row = (
        await conn.execute(
            update(agent_sets)
            .where(agent_sets.c.tenant_id == tenant_id)
            .values(
                revision=agent_sets.c.revision + 1,
                default_agent=default_agent,
                updated_at=func.now(),
            )
            .returning(agent_sets.c.revision)
        )
    ).one()
    return int(row.revision)


async def default_agent(conn: AsyncConnection, tenant_id: str) -> str | None:
    """The tenant's default agent, or None."""
    found = await conn.execute(
        select(agent_sets.c.default_agent).where(agent_sets.c.tenant_id == tenant_id)
    )
    return found.scalar()


async def routed_set(
    conn: AsyncConnection, tenant_id: str
) -> tuple[int, str | None, list[Version]]:
    """What routing reads of a tenant's agents: its revision, its default agent and every
    agent's published version (revision 0 and none: the tenant has no agents)."""
    found = (
        await conn.execute(
            select(agent_sets.c.revision, agent_sets.c.default_agent).where(
                agent_sets.c.tenant_id == tenant_id
            )
        )
    ).first()
    if found is None:
        return 0, None, []
    return int(found.revision), found.default_agent, await published_all(conn, tenant_id)


def _version(row: Any) -> Version:
    return Version(
        row.name,
        int(row.version),
        row.written,
        dict(row.normalised),
        row.digest,
        dict(row.created_by),
        row.created_at,
    )


# Each agent with its published version's row.
_PUBLISHED = agents.join(
    agent_versions,
    and_(
        agent_versions.c.tenant_id == agents.c.tenant_id,
        agent_versions.c.name == agents.c.name,
        agent_versions.c.version == agents.c.published_version,
    ),
)


def published(tenant_id: Any, name: Any) -> Exists:
    """Whether the tenant has the agent `name`, published (an expression)."""
    return (
        select(agents.c.name)
        .select_from(_PUBLISHED)
        .where(agents.c.tenant_id == tenant_id, agents.c.name == name)
        .exists()
    )


async def published_version(conn: AsyncConnection, tenant_id: str, name: str) -> Version | None:
    """The agent's published version, or None when the tenant has no such agent."""
    row = (
        await conn.execute(
            select(agent_versions)
            .select_from(_PUBLISHED)
            .where(agents.c.tenant_id == tenant_id, agents.c.name == name)
        )
    ).first()
    return None if row is None else _version(row)


async def version_of(
    conn: AsyncConnection, tenant_id: str, name: str, version: int
) -> Version | None:
    """One version of the agent, or None."""
    row = (
        await conn.execute(
            select(agent_versions).where(
                agent_versions.c.tenant_id == tenant_id,
                agent_versions.c.name == name,
                agent_versions.c.version == version,
            )
        )
    ).first()
    return None if row is None else _version(row)


async def versions(conn: AsyncConnection, tenant_id: str, name: str) -> list[Version]:
    """Every version of the agent, oldest first (none: no such agent)."""
    rows = await conn.execute(
        select(agent_versions)
        .where(agent_versions.c.tenant_id == tenant_id, agent_versions.c.name == name)
        .order_by(agent_versions.c.version)
    )
    return [_version(row) for row in rows]


async def listed(conn: AsyncConnection, tenant_id: str) -> list[Published]:
    """The tenant's agents by name, each with its published version."""
    rows = await conn.execute(
        select(agents.c.name, agents.c.published_version, agents.c.updated_at)
        .where(agents.c.tenant_id == tenant_id)
        .order_by(agents.c.name)
    )
    return [Published(r.name, int(r.published_version), r.updated_at) for r in rows]


async def published_all(conn: AsyncConnection, tenant_id: str) -> list[Version]:
    """The published version of every agent of the tenant (routing's input), in one statement."""
    rows = await conn.execute(
        select(agent_versions)
        .select_from(_PUBLISHED)
        .where(agents.c.tenant_id == tenant_id)
        .order_by(agents.c.name)
    )
    return [_version(row) for row in rows]


async def add_version(
    conn: AsyncConnection,
    tenant_id: str,
    name: str,
    *,
    written: str,
    normalised: Mapping[str, Any],
    digest: str,
    created_by: Mapping[str, Any],
) -> int:
    """Store the next version of the agent (made if new) and publish it; its number. Called
    under the tenant's set lock, so the next number is nobody else's."""
    await conn.execute(
        pg_insert(agents)
        .values(tenant_id=tenant_id, name=name, published_version=1)
        .on_conflict_do_nothing(index_elements=["tenant_id", "name"])
    )
    latest = (
        await conn.execute(
            select(func.coalesce(func.max(agent_versions.c.version), 0)).where(
                agent_versions.c.tenant_id == tenant_id, agent_versions.c.name == name
            )
        )
    ).scalar_one()
    version = int(latest) + 1
    await conn.execute(
        agent_versions.insert().values(
            tenant_id=tenant_id,
            name=name,
            version=version,
            written=written,
            normalised=dict(normalised),
            digest=digest,
            created_by=dict(created_by),
        )
    )
    await publish(conn, tenant_id, name, version)
    return version


async def publish(conn: AsyncConnection, tenant_id: str, name: str, version: int) -> None:
    """Make `version` the agent's published one."""
    await conn.execute(
        update(agents)
        .where(agents.c.tenant_id == tenant_id, agents.c.name == name)
        .values(published_version=version, updated_at=func.now())
    )


async def remove(conn: AsyncConnection, tenant_id: str, name: str) -> None:
    """Remove the agent and its versions (runs pinned to one keep their routing: `routings`
    holds it whole)."""
    await conn.execute(delete(agents).where(agents.c.tenant_id == tenant_id, agents.c.name == name))


async def pinned_runs(
    conn: AsyncConnection, tenant_id: str, name: str, limit: int
) -> Sequence[str]:
    """Up to `limit` unfinished runs of the tenant pinned to a version of the agent."""
    rows = await conn.execute(
        select(runs.c.run_id)
        .select_from(keyed_runs().join(routings, routings.c.routing_id == runs.c.routing_id))
        .where(
            run_keys.c.tenant_id == tenant_id,
            runs.c.status.in_(UNFINISHED),
            routings.c.config["agent"].astext == name,
            routings.c.config.has_key(AGENT_VERSION),
        )
        .order_by(run_keys.c.created_at)
        .limit(limit)
    )
    return [row.run_id for row in rows]


async def tenant_has_agents(conn: AsyncConnection, tenant_id: str) -> bool:
    """Whether the tenant's agents are left (their set: every apply writes it, and it outlives
    its last removed agent)."""
    found = select(agent_sets.c.tenant_id).where(agent_sets.c.tenant_id == tenant_id).exists()
    return bool((await conn.execute(select(found))).scalar())


async def delete_tenant(conn: AsyncConnection, tenant_id: str) -> int:
    """Remove a deleted tenant's agents, versions and set; how many agents."""
    await conn.execute(delete(agent_sets).where(agent_sets.c.tenant_id == tenant_id))
    result = await conn.execute(delete(agents).where(agents.c.tenant_id == tenant_id))
    return int(result.rowcount or 0)
