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
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import Text, bindparam, case, func, literal, select
from sqlalchemy.ext.asyncio import AsyncConnection

from services.orchestrator.repositories.answers import shown_result_text
from tether.db.schema import attempts, runs, usage_turns
from tether.domain import AgentConfig, EndedChild, Limits, Run, RunError
from tether.errors import InvalidArgument
from tether.states import TERMINAL

_ENDED = frozenset(s.value for s in TERMINAL)

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


# What a run's subtree spent, by the branch it was spent in: the run's own turns (top NULL) and
# each child's subtree (top: that child), with each child's status and reserve; and the
# seconds the run's attempts ran. One statement (a recursive walk of the subtree), however many
# children the run has.
_TREE = (
    select(runs.c.run_id.label("run_id"), literal(None, Text).label("top"))
    .where(runs.c.run_id == bindparam("b_run_id"))
    .cte("tree_ids", recursive=True)
)
_BELOW = runs.alias("tree_child")
_TREE = _TREE.union_all(
    select(_BELOW.c.run_id, func.coalesce(_TREE.c.top, _BELOW.c.run_id)).where(
        _BELOW.c.tree_parent_run_id == _TREE.c.run_id
    )
)
_USED = (
    select(
        _TREE.c.top,
        func.coalesce(func.sum(usage_turns.c.input_tokens), 0).label("max_input_tokens"),
        func.coalesce(func.sum(usage_turns.c.output_tokens), 0).label("max_output_tokens"),
        func.coalesce(func.sum(usage_turns.c.cost_micros), 0).label("max_cost_micros"),
        func.count(usage_turns.c.id).label("max_steps"),
    )
    .select_from(_TREE.outerjoin(usage_turns, usage_turns.c.run_id == _TREE.c.run_id))
    .group_by(_TREE.c.top)
    .cte("used")
)
_TOP = runs.alias("top_run")


def _account(current: bool) -> Any:
    ran = (
        select(func.coalesce(func.sum(func.extract("epoch", _ran(current))), 0))
        .where(attempts.c.run_id == bindparam("b_run_id"))
        .scalar_subquery()
    )
    # At a lease (not `current`), each child's end too: a resumed run's delegate calls are
    # answered from the lease.
    ends = () if current else (_TOP.c.tree_call_id, shown_result_text(_TOP), _TOP.c.error)
    return select(
        *_USED.c, _TOP.c.status, _TOP.c.tree_budget, *ends, ran.label("elapsed_s")
    ).select_from(_USED.outerjoin(_TOP, _TOP.c.run_id == _USED.c.top))


_ACCOUNT = {current: _account(current) for current in (False, True)}


@dataclass(frozen=True, slots=True)
class Account:
    """What a run has left for itself and new children in each dimension it has a ceiling in
    (its ceilings less what its subtree spent, less what its active children still hold in
    reserve), and the seconds its attempts ran (the one under way too when asked)."""

    left: dict[str, int]
    elapsed_s: float
    # The children that have ended (read at a lease only).
    ended: tuple[EndedChild, ...] = ()


async def account(
    conn: AsyncConnection, run: Run, limits: Limits, *, current: bool = False
) -> Account:
    """The run's account (see `Account`): one statement."""
    remaining = ceilings(limits, run.tree_budget)
    elapsed = 0.0
    ended: list[EndedChild] = []
    for row in await conn.execute(_ACCOUNT[current], {"b_run_id": run.run_id}):
        elapsed = float(row.elapsed_s or 0)
        active = row.top is not None and row.status not in _ENDED
        reserve = (row.tree_budget or {}) if active else {}
        for name in remaining:
            used = int(getattr(row, name))
            remaining[name] -= used + max(int(reserve.get(name, 0)) - used, 0)
        if not current and row.top is not None and not active and row.tree_call_id:
            error = RunError.from_row(row.error) if row.error else None
            ended.append(
                EndedChild(row.tree_call_id, row.top, row.status, row.result_text or "", error)
            )
    return Account(remaining, elapsed, tuple(ended))


async def child_budget(
    conn: AsyncConnection, parent: Run, limits: Limits, share: int
) -> dict[str, float]:
    """The ceilings a new child of `parent` (whose pinned routing's limits are `limits`)
    reserves: 1/`share` of what the parent has left in
    each dimension it has a ceiling in, and its wall-clock time left (children run at once: each
    may take all of it). InvalidArgument (the model reads it) when the parent has nothing left
    to give in one of them."""
    found = await account(conn, parent, limits, current=True)
    remaining = found.left
    exhausted = [_WORDS[name] for name, value in remaining.items() if value <= 0]
    clock = wall_clock_ceiling(limits, parent.tree_budget)
    time_left = clock - found.elapsed_s if clock else 0.0
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


@dataclass(frozen=True, slots=True)
class LeasedTrees:
    """What leased runs of trees run with, by run id: a configuration where it differs from
    its routing's (`configs`), and the children that have ended, where any have (`ended`)."""

    configs: dict[str, AgentConfig]
    ended: dict[str, tuple[EndedChild, ...]]


async def leased_configs(
    conn: AsyncConnection, leased: Iterable[tuple[Run, AgentConfig]]
) -> LeasedTrees:
    """The configuration each leased run runs with, by run id, when it differs from its
    routing's: a run of a tree has its ceilings lowered to what it has left, and a run leased
    before has its wall clock lowered by what its attempts ran (the others are left out); and
    the children of each that have ended, read in the same account."""
    found: dict[str, AgentConfig] = {}
    leased = list(leased)

    # A run leased before (a retry, a resume, a requeue) has spent some of its wall clock, and
    # one of a tree some of its ceilings: a tree's such run reads both in its account (one
    # statement each), the batch's other such runs their time in one statement. A run at its
    # first lease (epoch 1) has run nothing, spent nothing and started no child: its ceilings
    # stand as its agent and its budget set them, with no statement.
    def in_tree(run: Run, config: AgentConfig) -> bool:
        return run.tree_budget is not None or config.delegation is not None

    accounts = {
        run.run_id: await account(conn, run, config.limits)
        for run, config in leased
        if run.lease_epoch > 1 and in_tree(run, config)
    }
    clocks = {
        run.run_id: clock
        for run, config in leased
        if (clock := wall_clock_ceiling(config.limits, run.tree_budget))
        and (run.lease_epoch > 1 or run.tree_budget is not None)
    }
    ran = {run_id: found.elapsed_s for run_id, found in accounts.items()}
    ran |= await elapsed_of(
        conn,
        [r.run_id for r, _ in leased if r.lease_epoch > 1 and r.run_id in clocks.keys() - ran],
    )
    for run, config in leased:
        lowered: dict[str, Any] = {}
        if run.run_id in clocks:
            spent_s = ran.get(run.run_id, 0.0)
            lowered[WALL_CLOCK] = max(clocks[run.run_id] - spent_s, LEAST_WALL_CLOCK_S)
        if in_tree(run, config):
            remaining = (
                accounts[run.run_id].left
                if run.run_id in accounts
                else ceilings(config.limits, run.tree_budget)
            )
            lowered |= {
                name: max(value, 0 if name == "max_steps" else 1)
                for name, value in remaining.items()
            }
        if lowered:
            found[run.run_id] = replace(config, limits=replace(config.limits, **lowered))
    ended = {run_id: held.ended for run_id, held in accounts.items() if held.ended}
    return LeasedTrees(found, ended)
