"""What is read back of a run: the run as it stands, its attempts, its priced model turns, its
log's events and the routing decision it is pinned to (its parts are `parts.Part`).

Frozen read models, each built once from a row's mapping by the repository that read it
(`from_row`), so nothing above the repositories handles a database row. Values are taken as
stored, unchecked: a claim and a completion build one per run hundreds of times a second, and
the database already holds them to their columns' types.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from operator import itemgetter
from typing import Any, Self


@dataclass(frozen=True, slots=True)
class Run:
    """A `runs` row: the run as it stood when it was read or moved. JSON columns (`error`,
    `usage`) are in the row's stored format (`format`, tether.formats); `status` is the stored
    RunStatus value."""

    run_id: str
    tenant_id: str
    session_id: str
    message_id: str
    conversation_id: str
    channel: str
    input_text: str
    status: str
    attempt: int
    max_attempts: int
    lease_owner: str | None
    lease_epoch: int
    lease_expires_at: datetime | None
    next_attempt_at: datetime | None
    cancel_requested_at: datetime | None
    waiting_interaction_id: str | None
    parent_run_id: str | None
    root_run_id: str
    result_text: str | None
    task_outcome: str | None
    warnings: Sequence[str]
    error: Mapping[str, Any] | None
    usage: Mapping[str, Any]
    routing_id: str | None
    traceparent: str | None
    last_seq: int
    session_head: bool
    checkpoint_batch: int
    owner_principal_id: str | None
    visibility: str
    format: int
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    # Its order within its tenant's queued runs (tether.priorities), and its start tag among
    # every tenant's (fair leases).
    priority: int
    fair_key: float
    # When its timer wakes a waiting-for-timer run (cleared when it fires or is cancelled).
    next_wake_at: datetime | None
    # The agent it is routed to, written by the lease that pins its routing (None before).
    agent_name: str | None = None
    # Its run tree: the run whose `delegate` call (`tree_call_id`) started it, the tree's root
    # (None for a run no call started: it is its own root) and its depth (0 at the root).
    tree_parent_run_id: str | None = None
    tree_call_id: str | None = None
    tree_root_run_id: str | None = None
    tree_depth: int = 0
    tree_reported_at: datetime | None = None
    # A child's ceilings, reserved out of what its parent had left (`services.orchestrator.
    # budgets`); None for a root.
    tree_budget: Mapping[str, Any] | None = None
    # Whether its tenant had a cap when it was queued (the claim finds it by a probe of its
    # tenant's, not in its fair scan); kept in step with the caps by the orchestrator.
    capped: bool = False
    # The agent whose cap held it back when a claim routed it (the claim finds it by a probe of
    # that agent's while it has room); cleared by its lease.
    held_agent: str | None = None

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> Self:
        """The run of a row carrying the `runs` columns (the columns beside them are left)."""
        return cls(*_RUN_COLUMNS(row))


@dataclass(frozen=True, slots=True)
class Attempt:
    """An `attempts` row: one lease of a run, from its start to how it ended. `stages` holds
    its stage durations as stored (`<stage>_ms`); `detail` what its worker reported of the
    ending (the model, the usage, the warnings): its audit record."""

    run_id: str
    lease_epoch: int
    attempt: int
    worker_id: str
    started_at: datetime
    ended_at: datetime | None
    outcome: str | None
    error: Mapping[str, Any] | None
    stages: Mapping[str, Any] | None
    detail: Mapping[str, Any] | None

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> Self:
        """The attempt of a row carrying the `attempts` columns."""
        return cls(*_ATTEMPT_COLUMNS(row))


@dataclass(frozen=True, slots=True)
class PricedTurn:
    """A `usage_turns` row: a model turn as priced and recorded, with the attempt that had
    started when it was (None when no attempt row precedes it)."""

    model: str
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    cost_micros: int
    created_at: datetime
    attempt: int | None

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> Self:
        """The turn of a row carrying the `usage_turns` columns and `attempt`."""
        return cls(*_TURN_COLUMNS(row))


@dataclass(frozen=True, slots=True)
class LoggedEvent:
    """An event of a run's log, its payload in its stored format: a `run_event_log` row."""

    run_id: str
    seq: int
    type: str
    payload: Mapping[str, Any]
    format: int
    created_at: datetime

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> Self:
        """The event of a row carrying the `run_event_log` columns."""
        return cls(*_EVENT_COLUMNS(row))


AGENT_VERSION = "agent_version"
"""The key of a routing's stored form naming the agent version it came from (a release before
agents reads past it)."""


@dataclass(frozen=True, slots=True)
class RunRouting:
    """The routing decision a run's current attempt runs with: its name in `routings` ("" for
    one a release before routings kept whole on the run) and its stored form
    (`AgentConfig.to_json`, plus `AGENT_VERSION` when a version of a stored agent made it)."""

    routing_id: str
    stored: Mapping[str, Any]

    @property
    def agent_version(self) -> int:
        """The version of the agent the run is pinned to; 0 when `tenants.agent` routed it."""
        return int(self.stored.get(AGENT_VERSION, 0))


# Each model's columns in its fields' order, picked from a row's mapping in one call.
_RUN_COLUMNS = itemgetter(*(f.name for f in fields(Run)))
_ATTEMPT_COLUMNS = itemgetter(*(f.name for f in fields(Attempt)))
_TURN_COLUMNS = itemgetter(*(f.name for f in fields(PricedTurn)))
_EVENT_COLUMNS = itemgetter(*(f.name for f in fields(LoggedEvent)))
