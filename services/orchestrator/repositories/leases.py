"""Leases: the claim (PostgreSQL as the queue), heartbeats, release and the reaper's reads.

The claim takes claimable runs with FOR UPDATE SKIP LOCKED, fairly across tenants (`fair`: the
least start tags, each filled with its tenant's best run by priority). Claimable means queued
AND its session's head: admission makes a run the head of an idle session, and a finishing
head hands the session to the oldest queued message (`transitions`), so a conversation
runs one message at a time, in order, and the claim's search is two indexed scans of one table.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import (
    BigInteger,
    Interval,
    Text,
    and_,
    bindparam,
    case,
    cast,
    func,
    insert,
    null,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection

from services.orchestrator.repositories import agent_caps, fair, history
from services.orchestrator.repositories.picked import Picked, picked
from services.orchestrator.repositories.transitions import (
    LEASE_UNTIL,
    NEXT_EPOCH,
    NOW,
    STARTED_ONCE,
    lease_held,
)
from tether import formats, states
from tether.db.direct import Direct
from tether.db.schema import (
    agent_sets,
    attempts,
    documents,
    in_state,
    messages,
    routings,
    runs,
    tenants,
)
from tether.domain import Run, RunError
from tether.states import RunStatus

# The routing the runs of each tenant, source and channel are leased with (`Route`).
_ROUTES = agent_caps.routes("route")
_PICKED = fair.PICKED
_AGENT = func.coalesce(tenants.c.agent, text("'{}'::jsonb"))  # as routing reads a missing one
# The revision of the tenant's agents (0: it has none, and runs with `tenants.agent`).
_REVISION = func.coalesce(agent_sets.c.revision, 0)
# Where each picked run came from (its message: one primary-key probe): routing picks the agent,
# persona and skills by its source, and the live facts name its actor.
_WITH_AGENT = (
    _PICKED.outerjoin(tenants, tenants.c.tenant_id == _PICKED.c.tenant_id)
    .outerjoin(agent_sets, agent_sets.c.tenant_id == _PICKED.c.tenant_id)
    .join(messages, messages.c.message_id == _PICKED.c.message_id)
)
_ROUTE_CHANNEL = agent_caps.route_channel(_PICKED.c.channel, messages)
# The agent a picked run runs as: the one its first lease wrote, else its route's; and its rank
# among the picked runs of its agent, in the order its tenant's turns took them (agent caps).
_RUN_AGENT = func.coalesce(_PICKED.c.agent_name, _ROUTES.c.agent_name)
_AGENT_NTH = func.row_number().over(
    partition_by=(_PICKED.c.tenant_id, _RUN_AGENT),
    order_by=(_PICKED.c.priority, _PICKED.c.fair_key, _PICKED.c.run_id),
)
_ROUTED = (
    select(
        _PICKED.c.run_id,
        _ROUTES.c.routing_id,
        _ROUTES.c.max_attempts,
        _ROUTES.c.routing_ms,
        _RUN_AGENT.label("agent_name"),
        _AGENT_NTH.label("agent_nth"),
        agent_caps.room_of(_PICKED.c.tenant_id, _RUN_AGENT).label("agent_room"),
    )
    .select_from(
        _WITH_AGENT.join(
            _ROUTES,
            and_(
                _ROUTES.c.tenant_id == _PICKED.c.tenant_id,
                _ROUTES.c.source == messages.c.source,
                _ROUTES.c.channel == _ROUTE_CHANNEL,
                _ROUTES.c.revision == _REVISION,
                # A route to one of the tenant's agents holds while its revision does; one
                # resolved from `tenants.agent`, while that is unchanged too.
                or_(_ROUTES.c.agent.is_(None), cast(_ROUTES.c.agent, JSONB) == _AGENT),
            ),
        )
    )
    .cte("routed")
)

# A run keeps the routing its first lease pinned on it: a resume days later, or a retry after
# the tenant changed its agent, runs with what the run started with.
_PINNED = runs.c.routing_id.is_not(None)
_WORKER = bindparam("c_worker_id", type_=Text)


_LEASED = (
    update(runs)
    .where(
        runs.c.run_id == _ROUTED.c.run_id,
        # Through coalesce: a plain `status = 'queued'` lets the planner reach the run by a
        # partial index of queued runs, reading every queued run past, when it thinks them
        # few (a reusable plan, or statistics older than a burst of admissions); this way only
        # pk_runs reaches it.
        func.coalesce(runs.c.status, "").in_([s.value for s in states.CLAIM.sources]),
        # Within its agent's cap, if it has one (agent_caps): the rest stay queued.
        or_(_ROUTED.c.agent_room.is_(None), _ROUTED.c.agent_nth <= _ROUTED.c.agent_room),
    )
    .values(
        status=states.CLAIM.target.value,
        updated_at=NOW,
        # One event: its run.started, read from the attempt's record (_NEW_ATTEMPTS).
        last_seq=runs.c.last_seq + 1,
        lease_owner=_WORKER,
        lease_epoch=NEXT_EPOCH,
        lease_expires_at=LEASE_UNTIL,
        checkpoint_batch=0,
        started_at=STARTED_ONCE,
        next_attempt_at=null(),
        routing_id=func.coalesce(runs.c.routing_id, _ROUTED.c.routing_id),
        agent_name=_ROUTED.c.agent_name,
        held_agent=null(),
        config=null(),  # written by releases before routings: the row sheds it
        max_attempts=case((_PINNED, runs.c.max_attempts), else_=_ROUTED.c.max_attempts),
        format=formats.CURRENT,
    )
    .returning(*runs.c, _ROUTED.c.routing_ms)
    .cte("moved")
)


# The attempt's record, which is its run.started too: the run's log reads the event from it, at
# the seq the move gave it (`run_event_log`), so the claim appends no event row.
_NEW_ATTEMPTS = insert(attempts).from_select(
    ["run_id", "lease_epoch", "attempt", "worker_id", "stages", "event_seq"],
    select(
        _LEASED.c.run_id,
        _LEASED.c.lease_epoch,
        _LEASED.c.attempt,
        _WORKER,
        func.jsonb_build_object("routing_ms", _LEASED.c.routing_ms),
        _LEASED.c.last_seq,
    ),
)
# Whether the run's session has an earlier completed run: its history is read only then.
_HAS_HISTORY = history.has_earlier_completed(_LEASED.c.session_id, _LEASED.c.created_at)
# Whether the run's tenant has knowledge documents: only then does the worker ask for any.
_HAS_DOCUMENTS = (
    select(documents.c.document_id).where(documents.c.tenant_id == _LEASED.c.tenant_id).exists()
)
# Routing decisions this replica had not stored yet, stored with the claim that first names
# them (a decision another replica stored first is left as it is: same name, same content).
_NEW_ROUTINGS = (
    pg_insert(routings)
    .from_select(
        ["routing_id", "config"],
        select(
            func.unnest(bindparam("ro_ids", type_=ARRAY(Text))),
            cast(func.unnest(bindparam("ro_configs", type_=ARRAY(Text))), JSONB),
        ),
    )
    .on_conflict_do_nothing()
)
# The claim (bench.topology_floor sends it bare, to measure what its records cost apart from
# the service around it).
CLAIM = Direct(
    select(
        _PICKED.c.run_id.label("picked_run_id"),
        _PICKED.c.tenant_id.label("picked_tenant_id"),
        messages.c.source.label("picked_source"),
        _ROUTE_CHANNEL.label("picked_channel"),
        messages.c.actor_type,
        messages.c.actor_id,
        messages.c.channel_origin,
        case((_LEASED.c.run_id.is_(None), _AGENT)).label("unrouted_agent"),
        # Routed but left queued: its agent's cap had no room for it.
        and_(_ROUTED.c.run_id.is_not(None), _LEASED.c.run_id.is_(None)).label("held_back"),
        _ROUTED.c.agent_name.label("routed_agent"),
        _REVISION.label("unrouted_revision"),
        _HAS_HISTORY.label("has_history"),
        _HAS_DOCUMENTS.label("has_documents"),
        *[_LEASED.c[c.name] for c in runs.c],
        _PICKED.c.updated_at.label("queued_at"),
        _LEASED.c.routing_ms,
    )
    .select_from(
        _WITH_AGENT.outerjoin(_ROUTED, _ROUTED.c.run_id == _PICKED.c.run_id).outerjoin(
            _LEASED, _LEASED.c.run_id == _PICKED.c.run_id
        )
    )
    .add_cte(
        _NEW_ATTEMPTS.cte("new_attempts"),
        _NEW_ROUTINGS.cte("new_routings"),
        fair.swapped(_LEASED),
    )
    # In the order the tenants' turns took them (a plan's joins may shuffle them).
    .order_by(_PICKED.c.fair_key, _PICKED.c.run_id)
)


@dataclass(frozen=True)
class Route:
    """How a tenant's runs from `source` on `channel` are leased: the routing resolved at the
    tenant's agents `revision` (0: it has none) and, when resolved from `tenants.agent`, from
    `agent` (its value then; None for one of the tenant's agents), and how long resolving it
    took in this claim."""

    tenant_id: str
    source: str
    channel: str
    agent: dict[str, Any] | None
    revision: int
    routing_id: str
    max_attempts: int
    routing_ms: float = 0.0
    # The agent it routes to (its configuration's `agent`), and that agent's cap on runs at
    # once (0: none).
    agent_name: str = ""
    max_running: int = 0


async def claim(conn: AsyncConnection, params: Mapping[str, Any]) -> Picked:
    """Lease up to `limit` claimable runs (queued session heads, oldest first, skipping those
    other claimers hold) to `worker_id` in ONE statement: each moves to running under a new
    lease epoch, its routing pinned on it (unless an earlier lease pinned one) and its attempt
    recorded, which its log reads as its run.started. `params`: what `claim_params` gives.

    The runs picked: those leased, those left queued (`Unrouted`) because their tenant,
    source and channel have no route here or its agent changed since, and the agents whose
    caps held some back."""
    return picked([row._mapping for row in await CLAIM.all(conn, params)])


def claim_params(
    *,
    worker_id: str,
    limit: int,
    ttl_s: float,
    routes: Sequence[Route],
    stored: Mapping[str, dict[str, Any]],
    locked: Collection[str] = (),
    locked_agents: Mapping[tuple[str, str], int] | None = None,
) -> dict[str, Any]:
    """The values `CLAIM` binds to lease up to `limit` runs to `worker_id` for `ttl_s`, on
    `routes`; `stored` are routing decisions (by routing id) to store with it: those the routes
    name that this replica has not stored yet; `locked`, the capped tenants the claim's
    transaction locked (`fair.lock_capped`): it leases for those within their caps, and for
    any other capped one not at all; `locked_agents`, the capped agents ((tenant, agent) to
    cap) it locked (`agent_caps.lock_agents`): it leases for those within their caps."""
    return {
        **agent_caps.cap_params(locked_agents or {}),
        "rt_agent_names": [r.agent_name for r in routes],
        "c_limit": limit,
        "c_worker_id": worker_id,
        "lease_ttl": timedelta(seconds=ttl_s),
        "rt_tenant_ids": [r.tenant_id for r in routes],
        "rt_sources": [r.source for r in routes],
        "rt_channels": [r.channel for r in routes],
        "rt_agents": [None if r.agent is None else json.dumps(r.agent) for r in routes],
        "rt_revisions": [r.revision for r in routes],
        "rt_routing_ids": [r.routing_id for r in routes],
        "ro_ids": list(stored),
        "c_capped": list(locked),
        "ro_configs": [json.dumps(config) for config in stored.values()],
        "rt_max_attempts": [r.max_attempts for r in routes],
        "rt_routing_ms": [r.routing_ms for r in routes],
    }


@dataclass(frozen=True)
class RouteFacts:
    """What routes a run: its message's `source`, the `channel` it routes by (with its
    connection's agent), its tenant's `agent` (`tenants.agent`) and agents' `revision`, and
    the agent its first lease wrote on it ("" until then)."""

    source: str
    channel: str
    agent: dict[str, Any]
    revision: int
    agent_name: str


_FACTS = (
    select(
        messages.c.source,
        agent_caps.route_channel(runs.c.channel, messages).label("channel"),
        func.coalesce(tenants.c.agent, text("'{}'::jsonb")).label("agent"),
        func.coalesce(agent_sets.c.revision, 0).label("revision"),
        runs.c.agent_name,
    )
    .select_from(
        runs.join(messages, messages.c.message_id == runs.c.message_id)
        .outerjoin(tenants, tenants.c.tenant_id == runs.c.tenant_id)
        .outerjoin(agent_sets, agent_sets.c.tenant_id == runs.c.tenant_id)
    )
    .where(runs.c.run_id == bindparam("f_run_id"))
)


async def route_facts(conn: AsyncConnection, run_id: str) -> RouteFacts | None:
    """What routes the run (None: absent)."""
    row = (await conn.execute(_FACTS, {"f_run_id": run_id})).first()
    if row is None:
        return None
    return RouteFacts(
        row.source, row.channel, dict(row.agent), int(row.revision), row.agent_name or ""
    )


_ROUTINGS = select(routings.c.routing_id, routings.c.config).where(
    routings.c.routing_id == func.any(bindparam("ro_wanted", type_=ARRAY(Text)))
)


async def routings_of(conn: AsyncConnection, routing_ids: Collection[str]) -> dict[str, Any]:
    """Stored routing decisions by id (their stored form), for those of `routing_ids` stored."""
    rows = await conn.execute(_ROUTINGS, {"ro_wanted": sorted(routing_ids)})
    return {row.routing_id: dict(row.config) for row in rows}


_CLAIMABLE_COUNT = select(func.count()).select_from(
    # In the claim's order: its index (ix_runs_fair), however the planner weighs the two.
    select(runs.c.run_id)
    .where(fair.CLAIMABLE, ~runs.c.capped, runs.c.held_agent.is_(None))
    .order_by(runs.c.fair_key)
    .limit(bindparam("limit"))
    .subquery()
)


async def count_claimable(conn: AsyncConnection, limit: int) -> int:
    """How many claimable runs there are, counting at most `limit` (locked ones too)."""
    return int((await conn.execute(_CLAIMABLE_COUNT, {"limit": limit})).scalar_one())


_HELD = (
    func.unnest(
        bindparam("h_run_ids", type_=ARRAY(Text)), bindparam("h_epochs", type_=ARRAY(BigInteger))
    )
    .table_valued("run_id", "epoch")
    .render_derived("held", with_types=False)
)
# The held runs still leased under their epochs, locked in run-id order ("C": as Python sorts
# them), the order a group commit writes them in (tether.db.committer): the two never wait
# for each other in a cycle. Left to the plan, the runs were locked in the table's order (a hash
# join over a scan), and a renewal deadlocked with a group of completions.
_LOCKED = (
    select(runs.c.run_id)
    .select_from(runs.join(_HELD, runs.c.run_id == _HELD.c.run_id))
    .where(lease_held(_HELD.c.epoch))
    .order_by(runs.c.run_id.collate("C"))
    .with_for_update(of=runs, key_share=True)
    .cte("locked")
)
_RENEW = (
    update(runs)
    .where(runs.c.run_id == _LOCKED.c.run_id)
    .values(lease_expires_at=func.now() + bindparam("h_ttl", type_=Interval))
    .returning(
        runs.c.run_id,
        runs.c.lease_epoch,
        runs.c.cancel_requested_at.is_not(None).label("cancel_requested"),
    )
)


async def renew(
    conn: AsyncConnection, held: Sequence[tuple[str, int]], ttl_s: float
) -> Sequence[Row[Any]]:
    """Extend every lease of `held` (run id, epoch) that is still current, in one statement:
    the renewed ones (run_id, lease_epoch, cancel_requested). One missing was reaped, released
    or leased again: its holder must stop."""
    if not held:
        return []
    params = {
        "h_run_ids": [run_id for run_id, _ in held],
        "h_epochs": [epoch for _, epoch in held],
        "h_ttl": timedelta(seconds=ttl_s),
    }
    return (await conn.execute(_RENEW, params)).all()


async def expired_leases(conn: AsyncConnection, limit: int) -> list[Run]:
    """Running runs whose lease expired, locked for the reaper."""
    stmt = (
        select(runs)
        .where(in_state(runs.c.status, RunStatus.RUNNING), runs.c.lease_expires_at < func.now())
        .order_by(runs.c.lease_expires_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    return [Run.from_row(row._mapping) for row in await conn.execute(stmt)]


async def due_retries(conn: AsyncConnection, limit: int) -> list[tuple[str, int]]:
    """Retry-pending runs whose backoff has elapsed (run id, attempt), locked for the
    scheduler."""
    stmt = (
        select(runs.c.run_id, runs.c.attempt)
        .where(
            in_state(runs.c.status, RunStatus.RETRY_PENDING),
            runs.c.next_attempt_at <= func.now(),
        )
        .order_by(runs.c.next_attempt_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    return [(row.run_id, row.attempt) for row in await conn.execute(stmt)]


_END_ATTEMPT = (
    update(attempts)
    .where(
        attempts.c.run_id == bindparam("a_run_id"), attempts.c.lease_epoch == bindparam("a_epoch")
    )
    .values(
        ended_at=func.now(),
        outcome=bindparam("a_outcome"),
        error=bindparam("a_error", type_=JSONB(none_as_null=True)),
        # Stages recorded at claim (routing) keep theirs; the worker's are added.
        stages=func.coalesce(attempts.c.stages, text("'{}'::jsonb")).op("||")(
            bindparam("a_stages", type_=JSONB)
        ),
        detail=bindparam("a_detail", type_=JSONB(none_as_null=True)),
    )
)


def end_attempt_statement() -> Any:
    """`end_attempt`'s statement, for the SQL functions built from the aggregate's own
    statements (`completion`)."""
    return _END_ATTEMPT


async def end_attempt(
    conn: AsyncConnection,
    run_id: str,
    epoch: int,
    outcome: str,
    *,
    error: RunError | None = None,
    stages: dict[str, Any] | None = None,
    detail: dict[str, Any] | None = None,
) -> None:
    """Close the attempt row of a lease epoch, adding `stages` to those recorded at claim, with
    `detail`: what the worker reported of how it ended (its audit record)."""
    params = {
        "a_run_id": run_id,
        "a_epoch": epoch,
        "a_outcome": outcome,
        "a_error": None if error is None else error.to_row(),
        "a_stages": stages or {},
        "a_detail": detail,
    }
    await conn.execute(_END_ATTEMPT, params)


def lease_cleared() -> dict[str, Any]:
    """Column values that drop a lease. A cancel request stays: only a run that ends cancelled
    ever leaves running with one (the moves elsewhere yield to it), and it records when."""
    return {"lease_owner": None, "lease_expires_at": None}
