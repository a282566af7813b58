"""A tenant's agents as versioned resources: apply (a new version, published), rollback, the
default agent, removal, and the reads; every change audited and bumping the tenant's agents
revision, which tells the claims their cached routes are stale.

The document itself (its schema, parsing, normalisation, route specificity) is
`tether.agent_spec`'s; this module decides versions and publishing and guards the tenant's
routes: two agents with an equal route are refused, naming both."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.orchestrator.catalog import ToolCatalog
from services.orchestrator.repositories import agents as agent_repo
from tether import audit
from tether.agent_spec import AgentSpec, Violation, parse, route_conflicts
from tether.agent_spec.violations import pointer, refusal
from tether.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound
from tether.ids import is_identifier
from tether.targets import TargetPolicy, check_url

# How many of the runs that pin an agent a refused removal names.
NAMED_PINNED_RUNS = 3


@dataclass(frozen=True, slots=True)
class Applied:
    """What an apply answers: the published version, and whether this apply created it."""

    name: str
    version: int
    created: bool


@dataclass(frozen=True, slots=True)
class Shown:
    """One version of an agent, with the agent's published version and whether it is the
    tenant's default."""

    version: agent_repo.Version
    published_version: int
    default: bool


@dataclass(frozen=True, slots=True)
class Listed:
    """An agent of the tenant as listed."""

    agent: agent_repo.Published
    default: bool


def _name(name: str) -> str:
    if not is_identifier(name):
        raise InvalidArgument(f"agent name {name!r} is not a name (letters, digits, _ and -)")
    return name


def _absent(name: str) -> NotFound:
    # Another tenant's agent is answered exactly as an absent one.
    return NotFound(f"agent {name!r} not found", details={"agent": name})


class Agents:
    """A tenant's agents, on the orchestrator's database."""

    def __init__(
        self,
        engine: AsyncEngine,
        catalog: ToolCatalog | None = None,
        target_policy: TargetPolicy | None = None,
    ) -> None:
        self._engine = engine
        self._catalog = catalog or ToolCatalog(engine)
        # Where an agent's MCP servers may be: the deployment's outbound-target policy.
        self._targets = target_policy or TargetPolicy.parse("")

    async def apply(
        self,
        tenant_id: str,
        text: str,
        actor: Mapping[str, str],
        base_version: int | None = None,
    ) -> Applied:
        """Create a version of the agent `text` describes and publish it. A document identical
        to the published version creates nothing and answers with it; `base_version` makes it
        conditional on the published version being that one (0: no such agent yet). A tool
        the catalog lacks, or a model without a price, refuses it (`ToolCatalog.check`)."""
        spec = parse(text)
        await self._check_mcp_urls(spec)
        await self._catalog.check(spec)
        async with self._engine.begin() as conn:
            found = await agent_repo.lock_set(conn, tenant_id)
            published = await agent_repo.published_version(conn, tenant_id, spec.name)
            current = 0 if published is None else published.version
            if base_version is not None and base_version != current:
                raise Aborted(
                    f"agent {spec.name!r} is at version {current}, not {base_version}: read it "
                    "again, then apply on the version it is at",
                    details={"agent": spec.name, "published_version": current},
                )
            if published is not None and published.digest == spec.digest:
                return Applied(spec.name, current, created=False)
            await self._refuse_conflicts(conn, tenant_id, spec.name, spec)
            await self._check_delegation(conn, tenant_id, spec)
            version = await agent_repo.add_version(
                conn,
                tenant_id,
                spec.name,
                written=spec.written,
                normalised=spec.normalised,
                digest=spec.digest,
                created_by=dict(actor),
            )
            default = found.default_agent
            if default is None and not spec.routes:
                default = spec.name  # a tenant's first agent without routes takes its runs
            await agent_repo.bump(conn, tenant_id, default_agent=default)
            await audit.record(
                conn,
                tenant_id=tenant_id,
                action="agent.applied",
                actor=actor,
                agent=spec.name,
                from_version=current,
                to_version=version,
            )
        return Applied(spec.name, version, created=True)

    async def _check_mcp_urls(self, spec: AgentSpec) -> None:
        """Refuse an MCP server URL the outbound-target policy forbids (a private address the
        operator does not allow, plain http over the internet, credentials in it), at its
        pointer, as channel URLs are refused."""
        found = []
        for at, server in enumerate(spec.normalised.get("mcp_servers", ())):
            try:
                await check_url(server["url"], self._targets, what="an MCP server's url")
            except InvalidArgument as exc:
                found.append(Violation(pointer(["mcp_servers", at, "url"]), exc.message))
        if found:
            raise refusal(found)

    async def _check_delegation(
        self, conn: AsyncConnection, tenant_id: str, spec: AgentSpec
    ) -> None:
        """Refuse a `delegation` naming an agent the tenant does not have (the agent itself
        may be named: its tree's depth bounds it), at its pointer."""
        named = spec.normalised.get("delegation", {}).get("agents", ())
        if not named:
            return
        known = {v.name for v in await agent_repo.published_all(conn, tenant_id)} | {spec.name}
        found = [
            Violation(
                pointer(["delegation", "agents", at]),
                f"names agent {name!r}, which this tenant does not have: apply it first, or "
                "drop it from delegation.agents",
            )
            for at, name in enumerate(named)
            if name not in known
        ]
        if found:
            raise refusal(found)

    async def _refuse_conflicts(
        self, conn: AsyncConnection, tenant_id: str, name: str, spec: AgentSpec
    ) -> None:
        """Refuse publishing `spec` as `name` when another agent has an equal route."""
        others = [
            (v.name, parse(v.written).routes)
            for v in await agent_repo.published_all(conn, tenant_id)
            if v.name != name
        ]
        conflicts = route_conflicts([*others, (name, spec.routes)])
        if conflicts:
            a, b, route = conflicts[0]
            raise InvalidArgument(
                f"agents {a!r} and {b!r} both declare the route {route}: a run would have two "
                "agents; change or remove one of them",
                details={"agents": [a, b]},
            )

    async def show(self, tenant_id: str, name: str, version: int | None = None) -> Shown:
        """One version of the agent (its published one unless `version` names another)."""
        async with self._engine.connect() as conn:
            published = await agent_repo.published_version(conn, tenant_id, _name(name))
            if published is None:
                raise _absent(name)
            wanted = published
            if version is not None and version != published.version:
                found = await agent_repo.version_of(conn, tenant_id, name, version)
                if found is None:
                    raise NotFound(f"agent {name!r} has no version {version}")
                wanted = found
            default = await self._default(conn, tenant_id)
        return Shown(wanted, published.version, default == name)

    async def listed(self, tenant_id: str) -> list[Listed]:
        """The tenant's agents, by name."""
        async with self._engine.connect() as conn:
            default = await self._default(conn, tenant_id)
            return [Listed(a, a.name == default) for a in await agent_repo.listed(conn, tenant_id)]

    async def versions(self, tenant_id: str, name: str) -> list[agent_repo.Version]:
        """Every version of the agent, oldest first."""
        async with self._engine.connect() as conn:
            found = await agent_repo.versions(conn, tenant_id, _name(name))
        if not found:
            raise _absent(name)
        return found

    async def rollback(
        self,
        tenant_id: str,
        name: str,
        to: int,
        actor: Mapping[str, str],
        base_version: int | None = None,
    ) -> Applied:
        """Publish version `to` of the agent again (runs routed from now on get it);
        `base_version` makes it conditional, like an apply's (Aborted, nothing written)."""
        async with self._engine.begin() as conn:
            found = await agent_repo.lock_set(conn, tenant_id)
            published = await agent_repo.published_version(conn, tenant_id, _name(name))
            if published is None:
                raise _absent(name)
            if base_version is not None and base_version != published.version:
                raise Aborted(
                    f"agent {name!r} is at version {published.version}, not {base_version}: "
                    "read it again, then roll back from the version it is at",
                    details={"agent": name, "published_version": published.version},
                )
            target = await agent_repo.version_of(conn, tenant_id, name, to)
            if target is None:
                raise NotFound(f"agent {name!r} has no version {to}")
            if to == published.version:
                return Applied(name, to, created=False)
            await self._refuse_conflicts(conn, tenant_id, name, parse(target.written))
            await agent_repo.publish(conn, tenant_id, name, to)
            await agent_repo.bump(conn, tenant_id, default_agent=found.default_agent)
            await audit.record(
                conn,
                tenant_id=tenant_id,
                action="agent.rolled_back",
                actor=actor,
                agent=name,
                from_version=published.version,
                to_version=to,
            )
        return Applied(name, to, created=True)

    async def set_default(self, tenant_id: str, name: str, actor: Mapping[str, str]) -> None:
        """Make the agent the tenant's default: it takes every run no route claims."""
        async with self._engine.begin() as conn:
            found = await agent_repo.lock_set(conn, tenant_id)
            if await agent_repo.published_version(conn, tenant_id, _name(name)) is None:
                raise _absent(name)
            if found.default_agent == name:
                return
            await agent_repo.bump(conn, tenant_id, default_agent=name)
            await audit.record(
                conn,
                tenant_id=tenant_id,
                action="agent.default_set",
                actor=actor,
                agent=name,
                from_agent=found.default_agent,
            )

    async def remove(self, tenant_id: str, name: str, actor: Mapping[str, str]) -> int:
        """Remove the agent and its versions, unless it is the default or an unfinished run is
        pinned to it; the version that was published."""
        async with self._engine.begin() as conn:
            found = await agent_repo.lock_set(conn, tenant_id)
            published = await agent_repo.published_version(conn, tenant_id, _name(name))
            if published is None:
                raise _absent(name)
            if found.default_agent == name:
                raise FailedPrecondition(
                    f"agent {name!r} is the tenant's default: make another agent the default "
                    "first (tether agents default NAME)"
                )
            pinned = await agent_repo.pinned_runs(conn, tenant_id, name, NAMED_PINNED_RUNS)
            if pinned:
                raise FailedPrecondition(
                    f"agent {name!r} is pinned by unfinished runs ({', '.join(pinned)}...): "
                    "remove it once they finish or are cancelled",
                    details={"runs": list(pinned)},
                )
            await agent_repo.remove(conn, tenant_id, name)
            await agent_repo.bump(conn, tenant_id, default_agent=found.default_agent)
            await audit.record(
                conn,
                tenant_id=tenant_id,
                action="agent.removed",
                actor=actor,
                agent=name,
                from_version=published.version,
                to_version=None,
            )
        return published.version

    @staticmethod
    async def _default(conn: AsyncConnection, tenant_id: str) -> str | None:
        return await agent_repo.default_agent(conn, tenant_id)
