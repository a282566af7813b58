"""Agent caps: how many of an agent's runs run at once (`limits.max_running` in its document),
held by the claim across every replica, as tenant caps are (`fair`).

A run's agent is known when it is routed: the claim's routes (`ROUTES`, what the replica
resolved for each tenant, source and channel) name the agent each takes, and a lease writes it
on the run (`runs.agent_name`, kept with its pinned routing). A replica's capped agents are
those its routes name with a cap (a cap set or changed since moves the tenant's agents'
revision, so the claim's own revision check sends the runs back to be routed again, and the
replica learns it before it leases one). While it knows of any, it claims in a transaction that
takes each capped agent's lock first (`lock_agents`, in key order, after the tenants'), then
counts in the claim's statement, whose snapshot is taken after the locks: the agent's running
runs (through ix_runs_running: as many rows as the pool runs, never its queued backlog), its
room left, and how many of the claim's picked runs it may take. A claim that knows no capped
agent binds empty arrays, and pays for none of it.

A run the claim picked and its agent's cap held back stays queued; the orchestrator then marks
it held (`hold_runs`: `runs.held_agent`), and every other claimable run of that agent's in the
background (`hold`), so that no scan of the claim's passes over them again, however many wait:
the claim reaches them by a probe of the agent's, as many as its room, while it has any
(`fair`). A lease clears the mark; so does the orchestrator once no cap holds the agent
(`release`: the cap was lifted, or the runs route elsewhere now), and a replica that finds runs
held for an agent it does not know (restarted) routes one of them first, learning the cap.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from sqlalchemy import (
    BigInteger,
    Float,
    Integer,
    Text,
    and_,
    bindparam,
    func,
    or_,
    select,
    true,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncConnection

from tether.db.schema import in_state, messages, runs
from tether.domain.channels import PIN_SEPARATOR
from tether.states import RunStatus


# The channel a run is routed by: its channel, and the agent its channel connection routes to
# when the connection names one (`slack/support`; channels and agent names are identifiers,
# which never hold a `/`).
def route_channel(channel: Any, message: Any) -> Any:
    """The channel a run on `channel` whose message is `message` (a messages table) routes by."""
    return channel + func.coalesce(
        PIN_SEPARATOR + func.nullif(message.c.channel_origin["agent"].astext, ""), ""
    )


def routes(name: str) -> Any:
    """The routing the runs of each tenant, source and channel are leased with, resolved by the
    caller (`leases.Route`), as a table named `name`: a run whose tenant, source and channel
    have no route, or whose tenant's agent changed since, is not leased."""
    return (
        func.unnest(
            bindparam("rt_tenant_ids", type_=ARRAY(Text)),
            bindparam("rt_sources", type_=ARRAY(Text)),
            bindparam("rt_channels", type_=ARRAY(Text)),
            bindparam("rt_agents", type_=ARRAY(Text)),
            bindparam("rt_revisions", type_=ARRAY(BigInteger)),
            bindparam("rt_routing_ids", type_=ARRAY(Text)),
            bindparam("rt_max_attempts", type_=ARRAY(Integer)),
            bindparam("rt_routing_ms", type_=ARRAY(Float)),
            bindparam("rt_agent_names", type_=ARRAY(Text)),
        )
        .table_valued(
            "tenant_id",
            "source",
            "channel",
            "agent",
            "revision",
            "routing_id",
            "max_attempts",
            "routing_ms",
            "agent_name",
        )
        .render_derived(name, with_types=False)
    )


# The capped agents this claim's transaction locked (`lock_agents`), each with its cap.
_CAPS = (
    func.unnest(
        bindparam("ca_tenant_ids", type_=ARRAY(Text)),
        bindparam("ca_agents", type_=ARRAY(Text)),
        bindparam("ca_caps", type_=ARRAY(Integer)),
    )
    .table_valued("tenant_id", "agent", "cap")
    .render_derived("agent_caps", with_types=False)
)
_RUNNING_OF_AGENT = (
    select(func.count())
    .where(
        in_state(runs.c.status, RunStatus.RUNNING),
        runs.c.tenant_id == _CAPS.c.tenant_id,
        runs.c.agent_name == _CAPS.c.agent,
    )
    .scalar_subquery()
)
# How many more runs each locked capped agent may run: its cap less its running runs, counted
# after the locks (see the module's docstring).
ROOM = select(
    _CAPS.c.tenant_id, _CAPS.c.agent, (_CAPS.c.cap - _RUNNING_OF_AGENT).label("room")
).cte("agent_room")

_HELD_PAIR = and_(
    runs.c.tenant_id == bindparam("h_tenant_id"), runs.c.held_agent == bindparam("h_agent")
)
_CLAIMABLE = and_(in_state(runs.c.status, RunStatus.QUEUED), runs.c.session_head)
# The channel key a run routes by: its message's source and route channel, as one string
# (`route_key`), so that a set of routes binds as one array.
_KEY_SEPARATOR = "\x1f"


def route_key(source: str, channel: str) -> str:
    """How `hold` names a route by its source and channel (neither holds the separator)."""
    return f"{source}{_KEY_SEPARATOR}{channel}"


_HOLD = (
    update(runs)
    .where(
        runs.c.tenant_id == bindparam("h_tenant_id"),
        _CLAIMABLE,
        runs.c.held_agent.is_(None),
        messages.c.message_id == runs.c.message_id,
        or_(
            runs.c.agent_name == bindparam("h_agent"),
            and_(
                runs.c.agent_name.is_(None),
                (messages.c.source + _KEY_SEPARATOR + route_channel(runs.c.channel, messages)).in_(
                    bindparam("h_keys", expanding=True)
                ),
            ),
        ),
    )
    .values(held_agent=bindparam("h_agent"))
)


async def hold(conn: AsyncConnection, tenant_id: str, agent: str, keys: Collection[str]) -> int:
    """Mark the tenant's claimable runs of `agent` held back by its cap (`runs.held_agent`):
    those its first lease pinned to it, and the others whose source and channel (`route_key`)
    are among `keys`, the routes to it. The claim finds them by the agent's probe from then on,
    and its scans no longer pass over them. How many were marked."""
    marked = await conn.execute(
        _HOLD, {"h_tenant_id": tenant_id, "h_agent": agent, "h_keys": sorted(keys)}
    )
    return int(marked.rowcount)


_HOLD_RUNS = (
    update(runs)
    .where(
        runs.c.run_id == func.any(bindparam("h_run_ids", type_=ARRAY(Text))),
        _CLAIMABLE,
        runs.c.held_agent.is_(None),
    )
    .values(held_agent=bindparam("h_agent"))
)


async def hold_runs(conn: AsyncConnection, agent: str, run_ids: Collection[str]) -> int:
    """Mark these claimable runs held back by `agent`'s cap (those a claim just held back: the
    claim's next look passes them by). How many were marked."""
    marked = await conn.execute(_HOLD_RUNS, {"h_agent": agent, "h_run_ids": sorted(run_ids)})
    return int(marked.rowcount)


_RELEASE = (
    update(runs)
    .where(_HELD_PAIR, in_state(runs.c.status, RunStatus.QUEUED))
    .values(held_agent=None)
)


async def release(conn: AsyncConnection, tenant_id: str, agent: str) -> int:
    """Clear the mark of the tenant's queued runs held for `agent` (no cap holds it now): they
    are the claim's to find in its scans again. How many."""
    cleared = await conn.execute(_RELEASE, {"h_tenant_id": tenant_id, "h_agent": agent})
    return int(cleared.rowcount)


# The tenants and agents with a held claimable run, each with one of those runs: one probe of
# ix_runs_agent_held per pair (a skip scan: as many steps as pairs, whatever their backlog).
_HELD_COLUMNS = (runs.c.tenant_id, runs.c.held_agent, runs.c.run_id)
_FIRST = (
    select(*_HELD_COLUMNS)
    .where(_CLAIMABLE, runs.c.held_agent.is_not(None))
    .order_by(runs.c.tenant_id, runs.c.held_agent)
    .limit(1)
    .subquery("first_pair")
)
_PAIRS = select(*_FIRST.c).cte("held_pairs", recursive=True)
_NEXT = (
    select(*_HELD_COLUMNS)
    .where(
        _CLAIMABLE,
        runs.c.held_agent.is_not(None),
        tuple_(runs.c.tenant_id, runs.c.held_agent)
        > tuple_(_PAIRS.c.tenant_id, _PAIRS.c.held_agent),
    )
    .order_by(runs.c.tenant_id, runs.c.held_agent)
    .limit(1)
    .lateral("next_pair")
)
_PAIRS = _PAIRS.union_all(select(*_NEXT.c).select_from(_PAIRS.join(_NEXT, true())))
_HELD_PAIRS = select(*_PAIRS.c)


async def held_pairs(conn: AsyncConnection) -> list[tuple[str, str, str]]:
    """Each tenant and agent with claimable runs held for it, and one of those runs' ids."""
    rows = await conn.execute(_HELD_PAIRS)
    return [(row.tenant_id, row.held_agent, row.run_id) for row in rows]


def room_of(tenant_id: Any, agent: Any) -> Any:
    """The room left under the cap of `tenant_id`'s agent `agent` (NULL: not capped)."""
    return (
        select(ROOM.c.room)
        .where(ROOM.c.tenant_id == tenant_id, ROOM.c.agent == agent)
        .scalar_subquery()
    )


def cap_params(locked: Mapping[tuple[str, str], int]) -> dict[str, Any]:
    """The values the claim binds for the capped agents `locked` ((tenant, agent) to cap)."""
    return {
        "ca_tenant_ids": [tenant for tenant, _ in locked],
        "ca_agents": [agent for _, agent in locked],
        "ca_caps": list(locked.values()),
    }


def _key(tenant_id: str, agent: str) -> str:
    return f"agent-cap:{tenant_id}/{agent}"


_LOCK = select(
    func.pg_advisory_xact_lock(
        func.hashtextextended(func.unnest(bindparam("la_keys", type_=ARRAY(Text))), 0)
    )
)


async def lock_agents(conn: AsyncConnection, capped: Mapping[tuple[str, str], int]) -> None:
    """Take each capped agent's lock (a transaction-level advisory lock on its name's hash, in
    that name's order: two claims never wait for each other in a cycle) until the caller's
    transaction ends. The claim that follows leases for them within their caps."""
    keys = sorted(_key(tenant, agent) for tenant, agent in capped)
    await conn.execute(_LOCK, {"la_keys": keys})


_AT_CAP = select(func.count()).where(
    in_state(runs.c.status, RunStatus.RUNNING),
    runs.c.tenant_id == bindparam("ac_tenant_id"),
    runs.c.agent_name == bindparam("ac_agent"),
)


async def running_of_agent(conn: AsyncConnection, tenant_id: str, agent: str) -> int:
    """How many runs of the tenant's agent run now."""
    found = await conn.execute(_AT_CAP, {"ac_tenant_id": tenant_id, "ac_agent": agent})
    return int(found.scalar_one())
