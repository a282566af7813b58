"""What the claim (`leases.claim`) returns for each run it picked: the run leased, with what its
attempt's inputs are read by, or left queued for want of a routing, with what resolves one."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from tether.domain import ReplyTarget, Run, origin_from_json


def _reply(stored: Mapping[str, Any] | None) -> ReplyTarget | None:
    origin = origin_from_json(stored)
    return None if origin is None else origin.reply


@dataclass(frozen=True, slots=True)
class Leased:
    """A run the claim leased, as it now stands, with the routing it is pinned to (a lease
    always pins one), its message's `source`, `actor_type` and
    `actor_id`; `has_history` when its session has an earlier completed run, `has_documents`
    when its tenant has knowledge documents; `queued_at`, when it was last moved before (by the
    database's clock), and `routing_ms`, what resolving its routing took (its attempt row
    records it; None for a route resolved before this claim's)."""

    run: Run
    routing_id: str
    source: str
    actor_type: str
    actor_id: str
    has_history: bool
    has_documents: bool
    queued_at: datetime
    routing_ms: float | None
    # Where its answer goes, when its message came through a channel connection.
    reply: ReplyTarget | None = None


@dataclass(frozen=True, slots=True)
class Unrouted:
    """A run the claim left queued: its tenant, source and channel have no route here, or the
    tenant's agents (their `revision`) or its `agent` changed since the route was resolved."""

    run_id: str
    tenant_id: str
    source: str
    channel: str
    agent: Mapping[str, Any]
    revision: int


@dataclass(frozen=True, slots=True)
class Picked:
    """What a claim did with the runs it picked: those `leased`, those left queued `unrouted`,
    and those their agents' caps `held` back (routed, and left queued), by tenant and agent."""

    leased: list[Leased]
    unrouted: list[Unrouted]
    held: dict[tuple[str, str], list[str]]


def picked(rows: Sequence[Mapping[Any, Any]]) -> Picked:
    """The claim's rows (their mappings), each read once."""
    leased: list[Leased] = []
    unrouted: list[Unrouted] = []
    held: dict[tuple[str, str], list[str]] = {}
    for row in rows:
        if row["held_back"]:
            # Routed, and left queued within its agent's cap (agent_caps).
            pair = (row["picked_tenant_id"], row["routed_agent"])
            held.setdefault(pair, []).append(row["picked_run_id"])
            continue
        if row["run_id"] is None:
            unrouted.append(
                Unrouted(
                    row["picked_run_id"],
                    row["picked_tenant_id"],
                    row["picked_source"],
                    row["picked_channel"],
                    row["unrouted_agent"],
                    int(row["unrouted_revision"]),
                )
            )
            continue
        leased.append(
            Leased(
                Run.from_row(row),
                row["routing_id"],
                row["picked_source"],
                row["actor_type"],
                row["actor_id"],
                bool(row["has_history"]),
                bool(row["has_documents"]),
                row["queued_at"],
                row["routing_ms"],
                _reply(row["channel_origin"]),
            )
        )
    return Picked(leased, unrouted, held)
