"""Budgets that flow down a run tree: a child's token, cost and step ceilings are reserved out of
what its parent has left when it starts, and what any run of a tree spends counts against every
run above it.

What a run has left is its ceilings (its agent's limits, lowered to its `tree_budget` when it is
a child) less what it and every run below it have spent (their priced turns, over all attempts)
less what its active children still hold in reserve. A child takes `1/share` of that (its
turn's delegate calls not started yet, itself included: parallel children split the remainder,
they do not each get it). A run in a tree is leased with its ceilings lowered to what it has
left, and the worker clamps each turn's `max_tokens` to the output tokens left: no run of a tree
can spend another's share, so a tree's output tokens stay within its root's ceiling, and its
input tokens and cost pass it by at most one turn (they are known only once the turn is over).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import replace
from typing import Any

from sqlalchemy import case, func, literal, select
from sqlalchemy.ext.asyncio import AsyncConnection

from tether.db.schema import attempts, routings, runs, usage_turns
from tether.domain import AgentConfig, Limits, Run
from tether.errors import InvalidArgument
from tether.states import TERMINAL

# The ceilings a tree shares, by their `Limits` names (0: none, but for max_steps).
DIMENSIONS = ("max_input_tokens", "max_output_tokens", "max_cost_micros", "max_steps")
_WORDS = {
    "max_input_tokens": "input tokens",
    "max_output_tokens": "output tokens",
    "max_cost_micros": "micro-USD",
    "max_steps": "model turns",
}


def ceilings(limits: Limits, budget: Mapping[str, Any] | None) -> dict[str, int]:
    """A run's ceilings by dimension: its agent's, lowered to its budget (a child's); a
    dimension with no ceiling is left out."""
    found: dict[str, int] = {}
    for name in DIMENSIONS:
        own = int(getattr(limits, name))
        share = int((budget or {}).get(name, 0))
        held = [v for v in (own, share) if v > 0]
        if held or (name == "max_steps" and budget and name in budget):
            found[name] = min(held) if held else 0
    return found


def _subtree_ids(run_id: str) -> Any:
    """The run and every run below it in its tree (a recursive CTE of run ids)."""
    below = select(literal(run_id).label("run_id")).cte("tree_ids", recursive=True)
    child = runs.alias("tree_child")
    return below.union_all(
        select(child.c.run_id).where(child.c.tree_parent_run_id == below.c.run_id)
    )


async def spent(conn: AsyncConnection, run_id: str) -> dict[str, int]:
    """What the run and every run below it have spent, over all their attempts."""
    ids = _subtree_ids(run_id)
    row = (
        await conn.execute(
            select(
                func.coalesce(func.sum(usage_turns.c.input_tokens), 0).label("input"),
                func.coalesce(func.sum(usage_turns.c.output_tokens), 0).label("output"),
                func.coalesce(func.sum(usage_turns.c.cost_micros), 0).label("cost"),
                func.count(usage_turns.c.id).label("steps"),
            ).where(usage_turns.c.run_id.in_(select(ids.c.run_id)))
        )
    ).one()
    return {
        "max_input_tokens": int(row.input),
        "max_output_tokens": int(row.output),
        "max_cost_micros": int(row.cost),
        "max_steps": int(row.steps),
    }


# The run-level deadline: `limits.wall_clock_seconds` counts the time the run's attempts ran,
# from its first start; time parked (for a person, a timer, its children) or waiting for a
# retry holds no attempt and does not count. A ceiling this close to spent still bounds the
# attempt (0 would be none).
WALL_CLOCK = "wall_clock_seconds"
LEAST_WALL_CLOCK_S = 0.001


def wall_clock_ceiling(limits: Limits, budget: Mapping[str, Any] | None) -> float:
    """The run's wall-clock ceiling in seconds (0: none): its agent's, lowered to its budget."""
    own, share = float(limits.wall_clock_seconds), float((budget or {}).get(WALL_CLOCK, 0))
    held = [v for v in (own, share) if v > 0]
    return min(held) if held else 0.0


def _ran(current: bool) -> Any:
    return case(
        (attempts.c.ended_at.is_not(None), attempts.c.ended_at - attempts.c.started_at),
        else_=(func.now() - attempts.c.started_at) if current else func.make_interval(),
    )


async def elapsed_s(conn: AsyncConnection, run_id: str, *, current: bool) -> float:
    """Seconds the run's attempts have run: those that ended, and with `current` the one under
    way, until now."""
    seconds = await conn.scalar(
        select(func.coalesce(func.sum(func.extract("epoch", _ran(current))), 0)).where(
            attempts.c.run_id == run_id
        )
    )
    return float(seconds or 0)


async def elapsed_of(conn: AsyncConnection, run_ids: Collection[str]) -> dict[str, float]:
    """Seconds each run's ended attempts ran, by run id, in one statement (none for none)."""
    if not run_ids:
        return {}
    found = await conn.execute(
        select(attempts.c.run_id, func.sum(func.extract("epoch", _ran(False))))
        .where(attempts.c.run_id.in_(list(run_ids)))
        .group_by(attempts.c.run_id)
    )
    return {row[0]: float(row[1] or 0) for row in found}


def _left(held: Mapping[str, int], used: Mapping[str, int]) -> dict[str, int]:
    return {name: held[name] - used.get(name, 0) for name in held}


async def pinned_config(conn: AsyncConnection, run: Run) -> AgentConfig | None:
    """The configuration of the routing a run is pinned to (a leased run's), None before."""
    stored = await conn.scalar(
        select(routings.c.config).where(routings.c.routing_id == run.routing_id)
    )
    return AgentConfig.from_json(stored) if stored else None


async def left(conn: AsyncConnection, run: Run, limits: Limits) -> dict[str, int]:
    """What the run has left for itself and new children: its ceilings less what its subtree
    spent, less what its active children still hold in reserve."""
    remaining = _left(ceilings(limits, run.tree_budget), await spent(conn, run.run_id))
    active = await conn.execute(
        select(runs.c.run_id, runs.c.tree_budget).where(
            runs.c.tree_parent_run_id == run.run_id,
            runs.c.status.not_in([s.value for s in TERMINAL]),
        )
    )
    for child in list(active):
        child_used = await spent(conn, child.run_id)
        for name, reserved in (child.tree_budget or {}).items():
            if name in remaining:
                remaining[name] -= max(int(reserved) - child_used.get(name, 0), 0)
    return remaining


async def child_budget(
    conn: AsyncConnection, parent: Run, limits: Limits, share: int
) -> dict[str, float]:
    """The ceilings a new child of `parent` (whose pinned routing's limits are `limits`)
    reserves: 1/`share` of what the parent has left in
    each dimension it has a ceiling in, and its wall-clock time left (children run at once: each
    may take all of it). InvalidArgument (the model reads it) when the parent has nothing left
    to give in one of them."""
    remaining = await left(conn, parent, limits)
    exhausted = [_WORDS[name] for name, value in remaining.items() if value <= 0]
    clock = wall_clock_ceiling(limits, parent.tree_budget)
    time_left = clock - await elapsed_s(conn, parent.run_id, current=True) if clock else 0.0
    if clock and time_left <= 0:
        exhausted.append("wall-clock time")
    if exhausted:
        raise InvalidArgument(
            f"this run has no budget left for a child ({', '.join(exhausted)} spent or "
            "reserved by its other children): do the task yourself, or answer with what you have"
        )
    budget: dict[str, float] = {
        name: max(value // max(share, 1), 1) for name, value in remaining.items()
    }
    if clock:
        budget[WALL_CLOCK] = round(time_left, 3)
    return budget


async def leased_configs(
    conn: AsyncConnection, leased: Iterable[tuple[Run, AgentConfig]]
) -> dict[str, AgentConfig]:
    """The configuration each leased run runs with, by run id, when it differs from its
    routing's: a run of a tree has its ceilings lowered to what it has left, and a run leased
    before has its wall clock lowered by what its attempts ran (the others are left out)."""
    found: dict[str, AgentConfig] = {}
    leased = list(leased)
    # A run leased before (a retry, a resume, a requeue) has spent some of its wall clock: what
    # the batch's such runs ran, in one statement for the batch. A run at its first lease
    # (epoch 1) has run nothing, spent nothing and started no child: its ceilings stand as its
    # agent and its budget set them, with no statement.
    clocks = {
        run.run_id: clock
        for run, config in leased
        if (clock := wall_clock_ceiling(config.limits, run.tree_budget))
        and (run.lease_epoch > 1 or run.tree_budget is not None)
    }
    ran = await elapsed_of(
        conn, [r.run_id for r, _ in leased if r.lease_epoch > 1 and r.run_id in clocks]
    )
    for run, config in leased:
        lowered: dict[str, Any] = {}
        if run.run_id in clocks:
            spent_s = ran.get(run.run_id, 0.0)
            lowered[WALL_CLOCK] = max(clocks[run.run_id] - spent_s, LEAST_WALL_CLOCK_S)
        if run.tree_budget is not None or config.delegation is not None:
            remaining = (
                ceilings(config.limits, run.tree_budget)
                if run.lease_epoch == 1
                else await left(conn, run, config.limits)
            )
            lowered |= {
                name: max(value, 0 if name == "max_steps" else 1)
                for name, value in remaining.items()
            }
        if lowered:
            found[run.run_id] = replace(config, limits=replace(config.limits, **lowered))
    return found
