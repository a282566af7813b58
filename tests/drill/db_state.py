"""What the invariant checker judges, read from the soak's PostgreSQL once it settled
(`read_state`): the runs, their messages, interactions, grants, parts, events, deliveries,
timers and lookup keys."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from tether.db.engine import create_engine
from tether.db.schema import (
    deliveries,
    grants,
    interactions,
    messages,
    run_event_log,
    run_keys,
    run_parts,
    runs,
)

# A run's lookup keys as `run_keys` holds them (migration 0046), and as its row has them.
KEYS = ("tenant_id", "created_at", "owner_principal_id", "session_id", "message_id")


@dataclass
class DbState:
    """The rows the checker needs, read once after the soak settled."""

    now: datetime
    runs: list[dict[str, Any]]
    messages: list[dict[str, Any]]
    interactions: list[dict[str, Any]]
    grants: list[dict[str, Any]]
    parts: dict[str, list[dict[str, Any]]]
    event_seqs: dict[str, set[int]]
    # run id -> its channel answer's delivery record (state, provider message id)
    deliveries: dict[str, dict[str, Any]] = field(default_factory=dict)
    # run id -> how many timer.set and timer.fired events its log holds
    timer_events: dict[str, Counter[str]] = field(default_factory=dict)
    # run id -> its keys in run_keys (KEYS)
    keys: dict[str, tuple[Any, ...]] = field(default_factory=dict)


async def read_state(db_url: str) -> DbState:
    """Everything `evaluate` judges, from the soak's database."""
    engine = create_engine(db_url, pool_size=1)
    try:
        return await read_state_for(engine)
    finally:
        await engine.dispose()


async def read_state_for(engine: AsyncEngine) -> DbState:
    """`read_state` on an engine the caller holds."""
    async with engine.connect() as conn:
        now = (await conn.execute(select(func.now()))).scalar_one()
        run_rows = [dict(r._mapping) for r in await conn.execute(select(runs))]
        message_rows = [
            dict(r._mapping)
            for r in await conn.execute(
                select(
                    messages.c.message_id,
                    messages.c.tenant_id,
                    messages.c.source,
                    messages.c.event_id,
                    messages.c.actor_id,
                )
            )
        ]
        interaction_rows = [dict(r._mapping) for r in await conn.execute(select(interactions))]
        grant_rows = [dict(r._mapping) for r in await conn.execute(select(grants))]
        parts: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in await conn.execute(select(run_parts).order_by(run_parts.c.part_index)):
            parts[r.run_id].append(dict(r._mapping))
        seqs: dict[str, set[int]] = defaultdict(set)
        for r in await conn.execute(select(run_event_log.c.run_id, run_event_log.c.seq)):
            seqs[r.run_id].add(int(r.seq))
        delivery_rows = {
            r.run_id: dict(r._mapping)
            for r in await conn.execute(
                select(deliveries.c.run_id, deliveries.c.state, deliveries.c.provider_message_id)
            )
        }
        timer_events: dict[str, Counter[str]] = defaultdict(Counter)
        for r in await conn.execute(
            select(run_event_log.c.run_id, run_event_log.c.type).where(
                run_event_log.c.type.in_(("timer.set", "timer.fired"))
            )
        ):
            timer_events[r.run_id][r.type] += 1
        keys = {
            r.run_id: tuple(r._mapping[k] for k in KEYS)
            for r in await conn.execute(select(run_keys))
        }
    return DbState(
        now,
        run_rows,
        message_rows,
        interaction_rows,
        grant_rows,
        parts,
        seqs,
        delivery_rows,
        timer_events,
        keys,
    )
