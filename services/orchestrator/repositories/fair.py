"""Fair leases: whose turn it is when the claim leases (`leases.CLAIM` picks its runs here).

Admission gives every run a start tag (`runs.fair_key`, start-time fair queueing: see
`intake`): the later of its tenant's finish tag and the queue's virtual time, its tenant's tag
moving on by 1 / weight. The claim's slots are the claimable runs with the least tags (one
indexed scan of ix_runs_fair, as many rows as it leases); each slot is its tenant's turn, filled
with that tenant's best claimable run by priority, then tag (one probe of
ix_runs_tenant_claimable per tenant with a slot). Neither grows with the number of tenants queued
or their backlog.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from sqlalchemy import Text, and_, bindparam, delete, func, select, true, union_all, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncConnection

from services.orchestrator.repositories import agent_caps
from tether.db.schema import in_state, runs, tenant_queues, tenant_stripes, tenants
from tether.states import RunStatus

CLAIMABLE = and_(in_state(runs.c.status, RunStatus.QUEUED), runs.c.session_head)
# Caps (tenants.max_running): the capped tenants this claim's transaction locked first
# (`lock_capped`); the runs of any other capped tenant wait for a claim that locks it (read
# here, through ix_tenants_capped: a cap set a moment ago holds at once, whatever this replica
# knows of it yet).
_LOCKED = bindparam("c_capped", type_=ARRAY(Text))
_UNLOCKED = select(tenants.c.tenant_id).where(
    tenants.c.max_running.is_not(None), tenants.c.tenant_id != func.all(_LOCKED)
)
_RUNNING_OF_TENANT = (
    select(func.count())
    .where(in_state(runs.c.status, RunStatus.RUNNING), runs.c.tenant_id == tenants.c.tenant_id)
    .scalar_subquery()
)
# How many more runs each locked capped tenant may run: its cap less its running runs, counted
# after the lock (this statement's snapshot is taken once it was granted, so it sees every lease
# committed before; no other claim leases for the tenant until this one commits). The running
# runs are bounded by the pool's slots: read once through ix_runs_running, whole (by the tenant
# too, the planner would AND in the tenant's index, every run the tenant ever had).
_RUNNING = (
    select(runs.c.tenant_id)
    .where(in_state(runs.c.status, RunStatus.RUNNING))
    .cte("running")
    .prefix_with("MATERIALIZED")
)
_ROOM = (
    select(
        tenants.c.tenant_id,
        (
            tenants.c.max_running
            - select(func.count())
            .select_from(_RUNNING)
            .where(_RUNNING.c.tenant_id == tenants.c.tenant_id)
            .scalar_subquery()
        ).label("room"),
    )
    .where(tenants.c.tenant_id == func.any(_LOCKED), tenants.c.max_running.is_not(None))
    .cte("room")
)
_HELD_BACK = and_(
    runs.c.tenant_id.not_in(select(_ROOM.c.tenant_id).where(_ROOM.c.room <= 0)),
    runs.c.tenant_id.not_in(_UNLOCKED),
)
# Not held back by an agent's cap (`runs.held_agent`): such a run is found by its agent's probe
# (`_AGENT_PICKS`), in no other scan (each holds only the others: the indexes' predicates).
_UNHELD = runs.c.held_agent.is_(None)
# Whose turn it is (fair leases): the claimable runs (queued session heads) with the least start
# tags, locked, skipping those another claimer holds. Each is a slot of its tenant's, filled
# below with that tenant's best run. An uncapped tenant's come from one indexed scan of
# ix_runs_fair; a capped tenant's (`runs.capped`) are not in it, so that a backlog held back by
# its cap is never passed over: each locked capped tenant's come from a probe of ix_runs_capped,
# as many as its room. A run queued as its tenant's cap was set may be in the scan: it is passed
# over while the tenant is held back (_HELD_BACK). A run an agent's cap held back is in neither
# (see `_AGENT_PICKS`).
_OPEN = (
    select(runs.c.run_id, runs.c.tenant_id, runs.c.fair_key)
    .where(CLAIMABLE, ~runs.c.capped, _UNHELD, _HELD_BACK)
    .order_by(runs.c.fair_key, runs.c.run_id)
    .limit(bindparam("c_limit"))
    .with_for_update(skip_locked=True)
    .cte("open_slots")
    .prefix_with("MATERIALIZED")
)
_IN_ROOM = (
    select(runs.c.run_id, runs.c.tenant_id, runs.c.fair_key)
    .where(runs.c.tenant_id == _ROOM.c.tenant_id, CLAIMABLE, runs.c.capped, _UNHELD)
    .order_by(runs.c.fair_key, runs.c.run_id)
    .limit(func.least(func.greatest(_ROOM.c.room, 0), bindparam("c_limit")))
    .with_for_update(skip_locked=True)
    .lateral("in_room")
)
_CAPPED_SLOTS = (
    select(*_IN_ROOM.c)
    .select_from(_ROOM.join(_IN_ROOM, true()))
    .cte("capped_slots")
    .prefix_with("MATERIALIZED")
)
# The columns a pick carries. updated_at: when the run last moved (queued, or handed its
# session): claim latency.
_PICK = (
    runs.c.run_id,
    runs.c.tenant_id,
    runs.c.channel,
    runs.c.message_id,
    runs.c.updated_at,
    runs.c.fair_key,
    runs.c.priority,
    runs.c.agent_name,
)
_PICK_ORDER = (runs.c.priority, runs.c.fair_key, runs.c.run_id)
# A run an agent's cap held back (`runs.held_agent`, marked by the orchestrator once a claim
# routed it and its agent had no room: `agent_caps.hold`) is in none of the scans above: a held
# backlog is never passed over. Each capped agent this claim locked with room left (its room
# counted after the lock) has its best held runs probed instead (ix_runs_agent_held: by
# priority, then tag), as many as its room: each is a slot of its tenant's, and one of the
# tenant's picks to choose from.
_AGENT_PROBE = (
    select(*_PICK)
    .where(
        runs.c.tenant_id == agent_caps.ROOM.c.tenant_id,
        runs.c.held_agent == agent_caps.ROOM.c.agent,
        CLAIMABLE,
        _HELD_BACK,
    )
    .order_by(*_PICK_ORDER)
    .limit(func.least(func.greatest(agent_caps.ROOM.c.room, 0), bindparam("c_limit")))
    .with_for_update(skip_locked=True)
    .lateral("agent_probe")
)
_AGENT_PICKS = (
    select(*_AGENT_PROBE.c)
    .select_from(agent_caps.ROOM.join(_AGENT_PROBE, true()))
    .where(agent_caps.ROOM.c.room > 0)
    .cte("agent_picks")
    .prefix_with("MATERIALIZED")
)
_BOTH = union_all(
    select(*_OPEN.c),
    select(*_CAPPED_SLOTS.c),
    select(_AGENT_PICKS.c.run_id, _AGENT_PICKS.c.tenant_id, _AGENT_PICKS.c.fair_key),
).subquery("both_slots")
SLOTS = (
    select(_BOTH.c.run_id, _BOTH.c.tenant_id, _BOTH.c.fair_key)
    .order_by(_BOTH.c.fair_key, _BOTH.c.run_id)
    .limit(bindparam("c_limit"))
    .cte("slots")
    .prefix_with("MATERIALIZED")
)
# Each tenant's slots, no more than its room under its cap (least() passes over no cap's NULL).
_TURNS = (
    select(SLOTS.c.tenant_id, func.least(func.count(), func.max(_ROOM.c.room)).label("n"))
    .select_from(SLOTS.outerjoin(_ROOM, _ROOM.c.tenant_id == SLOTS.c.tenant_id))
    .group_by(SLOTS.c.tenant_id)
    .cte("turns")
)
# Each tenant's best claimable runs, as many as its slots: by priority, then start tag (one
# probe of ix_runs_tenant_claimable per tenant with a slot, and its agents' held runs probed
# above). A run leased in another's slot leaves its own tag queued for the tenant's next turn,
# so the tenant's share is its slots'.
_OWN = (
    select(*_PICK)
    .where(runs.c.tenant_id == _TURNS.c.tenant_id, CLAIMABLE, _UNHELD)
    .order_by(*_PICK_ORDER)
    .limit(_TURNS.c.n)
    .with_for_update(skip_locked=True)
    .correlate(_TURNS)
    .subquery("own")
)
_CANDIDATES = union_all(
    select(*_OWN.c),
    select(*_AGENT_PICKS.c).where(_AGENT_PICKS.c.tenant_id == _TURNS.c.tenant_id).correlate(_TURNS),
).subquery("candidates")
_BEST = (
    select(*_CANDIDATES.c)
    .order_by(_CANDIDATES.c.priority, _CANDIDATES.c.fair_key, _CANDIDATES.c.run_id)
    .limit(_TURNS.c.n)
    .lateral("best")
)
# The runs picked, locked. Materialized: it is read more than once.
# The limit changes nothing (a tenant has no more picks than slots, and there are c_limit
# slots at most) but what the planner expects: without it, it reckons each tenant's picks at a
# tenth of its backlog, and past a few thousand held runs read every message to join them.
PICKED = (
    select(*_BEST.c)
    .select_from(_TURNS.join(_BEST, true()))
    .limit(bindparam("c_limit"))
    .cte("picked")
    .prefix_with("MATERIALIZED")
)


def _ranked(cte: Any, *, unless_in: Any) -> Any:
    """`cte`'s runs not in `unless_in`, numbered within their tenant in tag order."""
    return select(
        cte.c.run_id,
        cte.c.tenant_id,
        cte.c.fair_key,
        func.row_number()
        .over(partition_by=cte.c.tenant_id, order_by=(cte.c.fair_key, cte.c.run_id))
        .label("nth"),
    ).where(cte.c.run_id.not_in(select(unless_in.c.run_id)))


# A tenant's run leased before older ones for its priority takes a slot's tag with it: the slot's
# run takes the leased run's later tag (the n-th slot passed over the n-th run leased past it),
# so the tenant's queued tags stay the ones a lease in tag order would leave, and its priorities
# reorder its own runs without moving its turns.


def swapped(leased: Any) -> Any:
    """The update (a CTE) that hands the slots passed over the tags of the runs `leased` (the
    claim's moved runs: a CTE with run_id, tenant_id and fair_key) past them."""
    passed = _ranked(SLOTS, unless_in=leased).cte("passed")
    past = _ranked(leased, unless_in=SLOTS).cte("past")
    return (
        update(runs)
        .where(
            runs.c.run_id == passed.c.run_id,
            past.c.tenant_id == passed.c.tenant_id,
            past.c.nth == passed.c.nth,
        )
        .values(fair_key=past.c.fair_key)
        .cte("swapped")
    )


_LOCK_CAPPED = (
    select(tenant_queues.c.tenant_id)
    .where(tenant_queues.c.tenant_id == func.any(bindparam("l_capped", type_=ARRAY(Text))))
    .order_by(tenant_queues.c.tenant_id)
    .with_for_update()
)


async def lock_capped(conn: AsyncConnection, capped: Collection[str]) -> list[str]:
    """Lock the rows of the `capped` tenants (tenant_queues, in tenant order: two claims never
    wait for each other in a cycle) until the caller's transaction ends: those with a row (a
    tenant has one from its first run on). The claim that follows in the transaction leases
    for these within their caps, and for the others not at all."""
    rows = await conn.execute(_LOCK_CAPPED, {"l_capped": sorted(capped)})
    return [row.tenant_id for row in rows]


_CAPPED = select(tenants.c.tenant_id).where(tenants.c.max_running.is_not(None))
_TENANT_IDS = bindparam("f_tenant_ids", type_=ARRAY(Text))


async def flag_capped(conn: AsyncConnection, tenant_ids: Collection[str], capped: bool) -> int:
    """Set `runs.capped` on the queued runs of these tenants (their cap was set, or removed):
    the claim finds them where it looks for such a tenant's runs. How many runs moved."""
    if not tenant_ids:
        return 0
    moved = await conn.execute(
        update(runs)
        .where(
            runs.c.tenant_id == func.any(_TENANT_IDS),
            in_state(runs.c.status, RunStatus.QUEUED),
            runs.c.capped.is_not(capped),
        )
        .values(capped=capped),
        {"f_tenant_ids": sorted(tenant_ids)},
    )
    return int(moved.rowcount)


# The tenants with a claimable capped run, one probe of ix_runs_capped per tenant (a skip scan:
# as many steps as such tenants, whatever their backlog).
_FLAGGED = select(func.min(runs.c.tenant_id).label("tenant_id")).where(CLAIMABLE, runs.c.capped)
_STEP = _FLAGGED.cte("flagged", recursive=True)
_STEP = _STEP.union_all(
    select(
        select(func.min(runs.c.tenant_id))
        .where(CLAIMABLE, runs.c.capped, runs.c.tenant_id > _STEP.c.tenant_id)
        .scalar_subquery()
    ).where(_STEP.c.tenant_id.is_not(None))
)
_FLAGGED_TENANTS = select(_STEP.c.tenant_id).where(_STEP.c.tenant_id.is_not(None))


async def flagged_tenants(conn: AsyncConnection) -> list[str]:
    """The tenants with a claimable run flagged `capped`."""
    return [row.tenant_id for row in await conn.execute(_FLAGGED_TENANTS)]


async def capped_tenants(conn: AsyncConnection) -> list[str]:
    """The tenants with a cap on runs running at once."""
    return [row.tenant_id for row in await conn.execute(_CAPPED)]


_AT_CAP = select(tenants.c.max_running).where(
    tenants.c.tenant_id == bindparam("t_tenant_id"),
    tenants.c.max_running.is_not(None),
    tenants.c.max_running <= _RUNNING_OF_TENANT,
)


async def tenant_at_cap(conn: AsyncConnection, tenant_id: str) -> int | None:
    """The tenant's cap when as many of its runs run as it allows (its queued runs wait for
    one to end); None otherwise."""
    cap = (await conn.execute(_AT_CAP, {"t_tenant_id": tenant_id})).scalar_one_or_none()
    return None if cap is None else int(cap)


async def delete_tenant(conn: AsyncConnection, tenant_id: str) -> int:
    """Remove a deleted tenant's finish tags (its runs gone first): its stripes and its row in
    tenant_queues; how many rows."""
    gone = await conn.execute(delete(tenant_stripes).where(tenant_stripes.c.tenant_id == tenant_id))
    row = await conn.execute(delete(tenant_queues).where(tenant_queues.c.tenant_id == tenant_id))
    return int(gone.rowcount) + int(row.rowcount)


async def tenant_has_tags(conn: AsyncConnection, tenant_id: str) -> bool:
    """Whether the tenant still has a finish tag (a stripe, or its row in tenant_queues)."""
    found = (
        select(tenant_queues.c.tenant_id)
        .where(tenant_queues.c.tenant_id == tenant_id)
        .union_all(
            select(tenant_stripes.c.tenant_id).where(tenant_stripes.c.tenant_id == tenant_id)
        )
    )
    return (await conn.execute(found)).first() is not None
