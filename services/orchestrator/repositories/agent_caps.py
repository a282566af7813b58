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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import BigInteger, Float, Integer, Text, bindparam, func, literal, or_, select
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
_FULL = select(ROOM.c.tenant_id).where(ROOM.c.room <= 0)

# A queued run's agent, as the claim's routes name it: the one it is pinned to, else its route's.
_MESSAGE = messages.alias("capped_message")
_ROUTE = routes("capped_route")
_ROUTE_AGENT = (
    select(_ROUTE.c.agent_name)
    .select_from(_MESSAGE)
    .join(
        _ROUTE,
        (_ROUTE.c.tenant_id == runs.c.tenant_id)
        & (_ROUTE.c.source == _MESSAGE.c.source)
        & (_ROUTE.c.channel == route_channel(runs.c.channel, _MESSAGE)),
    )
    .where(_MESSAGE.c.message_id == runs.c.message_id)
    .limit(1)
    .scalar_subquery()
)
# Runs the claim passes over: those of an agent with no room left. Only a tenant with a full
# agent reads its runs' routes (the first arm answers for every other, and for all while none
# is full); a run with no route here ('') is picked, to be routed.
NOT_HELD = or_(
    runs.c.tenant_id.not_in(_FULL),
    func.coalesce(runs.c.agent_name, _ROUTE_AGENT, literal("")).not_in(
        select(ROOM.c.agent).where(ROOM.c.tenant_id == runs.c.tenant_id, ROOM.c.room <= 0)
    ),
)


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
