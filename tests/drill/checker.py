"""The invariant checker: reads PostgreSQL (`read_state`, tests.drill.db_state), then judges it
together with the ledger's records and what the clients saw (`evaluate`). Each invariant is a
count that must be 0, with a few example ids beside it so a failure can be looked up."""

from __future__ import annotations

import bisect
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from tests.drill.db_state import KEYS, DbState, read_state, read_state_for
from tests.drill.tree_checks import tree_and_timer_counts, trees_and_timers
from tether.testing.ledger import LedgerRecord

__all__ = ["DbState", "Seen", "evaluate", "read_state", "read_state_for"]

TERMINAL = ("completed", "failed", "cancelled")
WAITING = ("waiting-for-question", "waiting-for-approval", "waiting-for-connection")
ALLOWING = ("allow-once", "allow-conversation", "allow-always")
BAD_CODES = ("INTERNAL", "UNKNOWN")
EXAMPLES = 5
# Clocks of this process and PostgreSQL's are the same machine's; this covers rounding only.
CLOCK_SLACK = timedelta(seconds=1)

INVARIANTS = (
    "stuck_runs",
    "duplicate_side_effects",
    "lost_persisted_parts",
    "lost_persisted_events",
    "runs_per_inbound_event_above_one",
    "executions_without_claim_or_grant",
    "accepted_cancels_not_cancelled",
    "internal_or_unknown_during_outage",
    "internal_or_unknown_outside_outage",
    "conflicting_deliveries_accepted",
    "decisions_accepted_twice",
    "channel_runs_per_event_above_one",
    "channel_events_answered_twice",
    "channel_deliveries_without_outcome",
    "quiet_runs_waiting_past_bound",
    "flood_without_quiet_runs_measured",
    "children_active_after_root_ended",
    "timers_fired_twice",
    "timers_lost",
    "run_keys_out_of_step",
)

# The flood (tests.drill.flood_load): while the flooding tenant has at least FLOOD_BACKLOG runs
# queued, a quiet tenant's run (its tenant had no other run waiting for a lease when it could be
# leased) waits, from that moment to its lease, for no more than QUIET_WAIT_BOUND of the flood's
# leases. The bound is counted in the flood's leases, not in seconds: how fast the pool goes is
# the machine's (a shared one halves it), whom the claim leases next is the claim's. Fair leases
# give a quiet tenant's run a tag at the queue's head (within one run's tag of the virtual time),
# so the flood's runs leased ahead of it are the few tied with it, plus the claims already under
# way: fewer than the pool's slots (3 workers of 8: 24). A claim in admission order would lease
# the whole backlog queued ahead of it first: FLOOD_BACKLOG or more. (A run of a tenant with
# runs of its own still waiting queues behind them, as it should: not measured.) The report
# gives the waits in seconds beside it, and the flood's own.
QUIET_WAIT_BOUND = 24
FLOOD_BACKLOG = 50

# A channel answer's outcomes (`deliveries.state`): anything else is still on its way.
DELIVERY_OUTCOMES = ("sent", "failed", "unknown", "denied")


@dataclass
class Seen:
    """What the clients and the fault injector saw (see tests.drill.load.Observations)."""

    transcripts: Mapping[str, Any] = field(default_factory=dict)
    accepted_cancels: Sequence[str] = ()
    calls: Sequence[Any] = ()
    outages: Sequence[tuple[float, float]] = ()
    conflicts_accepted: Sequence[str] = ()
    # event id -> the run ids SendMessage answered for it (first delivery and duplicates)
    deliveries: Mapping[str, set[str]] = field(default_factory=dict)
    decisions_accepted_twice: Sequence[str] = ()
    recoveries_s: Sequence[float] = ()
    unrecovered: Sequence[str] = ()
    # Slack event id -> the run ids its webhook deliveries were answered with
    channel_runs: Mapping[str, set[str]] = field(default_factory=dict)
    # Slack event id -> how many answers the bot posted in its message's thread
    channel_replies: Mapping[str, int] = field(default_factory=dict)
    # The tenant flooding the pool (tests.drill.flood_load); None: no flood.
    flood_tenant: str | None = None


def _keys_out_of_step(state: DbState) -> list[str]:
    """Runs whose keys in `run_keys` are missing or not the run's own, and keys of no run: the
    triggers on `runs` keep them in step through every kill and restart."""
    expected = {r["run_id"]: tuple(r[k] for k in KEYS) for r in state.runs}
    return sorted(
        run_id
        for run_id in expected.keys() | state.keys.keys()
        if expected.get(run_id) != state.keys.get(run_id)
    )


def evaluate(state: DbState, ledger: Iterable[LedgerRecord], seen: Seen) -> dict[str, Any]:
    """The report: run counts, each invariant's count (all must be 0), recovery times."""
    by_id = {r["run_id"]: r for r in state.runs}
    found: dict[str, list[str]] = {name: [] for name in INVARIANTS}
    records = list(ledger)

    waiting_on_person = _stuck(state, found["stuck_runs"])
    _duplicate_effects(records, found["duplicate_side_effects"])
    _lost_parts(state, by_id, seen.transcripts, found)
    _runs_per_event(state, seen.deliveries, found["runs_per_inbound_event_above_one"])
    _unauthorised(state, by_id, records, found["executions_without_claim_or_grant"])
    found["accepted_cancels_not_cancelled"] = [
        run_id
        for run_id in seen.accepted_cancels
        if by_id.get(run_id, {}).get("status") != "cancelled"
    ]
    for call in seen.calls:
        if call.code in BAD_CODES:
            during = any(start <= call.at <= end for start, end in seen.outages)
            name = (
                "internal_or_unknown_during_outage"
                if during
                else ("internal_or_unknown_outside_outage")
            )
            found[name].append(f"{call.method}: {call.code} {call.detail}")
    _channel_answers(state, by_id, seen, found)
    trees_and_timers(state, by_id, found)
    flood = _quiet_waits(state, seen, found)
    found["conflicting_deliveries_accepted"] = list(seen.conflicts_accepted)
    found["decisions_accepted_twice"] = list(seen.decisions_accepted_twice)
    found["run_keys_out_of_step"] = _keys_out_of_step(state)

    statuses = Counter(r["status"] for r in state.runs)
    failed = Counter(
        str((r["error"] or {}).get("code", "unknown"))
        for r in state.runs
        if r["status"] == "failed"
    )
    recoveries = list(seen.recoveries_s)
    invariants = {name: len(items) for name, items in found.items()}
    return {
        "runs": {
            "admitted": len(state.runs),
            "completed": statuses["completed"],
            "failed": dict(sorted(failed.items())),
            "cancelled": statuses["cancelled"],
            "waiting_on_person": waiting_on_person,
            "in_flight": sum(statuses[s] for s in ("running", "retry-pending")),
        },
        "invariants": invariants,
        "examples": {name: items[:EXAMPLES] for name, items in found.items() if items},
        "recovery_after_worker_kill_s": {
            "runs": len(recoveries),
            "mean": round(sum(recoveries) / len(recoveries), 3) if recoveries else None,
            "max": max(recoveries) if recoveries else None,
            # Not back within the bound (e.g. the orchestrator was being restarted meanwhile);
            # a run that never moved again is counted as stuck at the end.
            "not_within_bound": list(seen.unrecovered),
        },
        "flood": flood,
        "trees_and_timers": tree_and_timer_counts(state),
        "failed_invariants": sorted(name for name, n in invariants.items() if n),
    }


def _quiet_waits(state: DbState, seen: Seen, found: dict[str, list[str]]) -> dict[str, Any]:
    """While the flooding tenant had FLOOD_BACKLOG runs or more queued, each quiet tenant's run
    is leased before the flood is leased QUIET_WAIT_BOUND more runs, counted from the moment the
    run could be leased: its admission, or, queued behind an earlier run of its session, that
    run's end (when the session was handed to it); quiet: no other run of its tenant was then
    admitted and not yet leased. From the runs' own times (a run's first lease, `started_at`,
    is its claim's transaction time, the same for every run of one claim)."""
    if seen.flood_tenant is None:
        return {}
    flood = [r for r in state.runs if r["tenant_id"] == seen.flood_tenant]
    flood_admitted = sorted(r["created_at"].timestamp() for r in flood)
    flood_leased = sorted(r["started_at"].timestamp() for r in flood if r["started_at"] is not None)
    # Each tenant's runs from admission to their first lease (or their end, never leased).
    waiting_from: dict[str, list[float]] = defaultdict(list)
    waiting_to: dict[str, list[float]] = defaultdict(list)
    for r in state.runs:
        end = r["started_at"] or r["finished_at"]
        waiting_from[r["tenant_id"]].append(r["created_at"].timestamp())
        waiting_to[r["tenant_id"]].append(float("inf") if end is None else end.timestamp())
    for times in (*waiting_from.values(), *waiting_to.values()):
        times.sort()

    def waiting(tenant: str, at: float) -> int:
        """The tenant's runs admitted by `at` and not leased (nor ended) by then."""
        return bisect.bisect_right(waiting_from[tenant], at) - bisect.bisect_right(
            waiting_to[tenant], at
        )

    def flood_leases(after: float, before: float) -> int:
        """The flood's first leases after `after` and before `before` (not in the same claim)."""
        return max(
            0, bisect.bisect_left(flood_leased, before) - bisect.bisect_right(flood_leased, after)
        )

    by_session: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in state.runs:
        by_session[r["session_id"]].append(r)
    overtaken, waits = [], []
    for session_runs in by_session.values():
        session_runs.sort(key=lambda r: (r["created_at"], r["run_id"]))
        before: dict[str, Any] | None = None
        for r in session_runs:
            ready, prior = r["created_at"].timestamp(), before
            before = r
            tenant = r["tenant_id"]
            if tenant == seen.flood_tenant or r["started_at"] is None:
                continue
            if prior is not None:
                if prior["finished_at"] is None:
                    continue  # leased while an earlier run held the session: not a queue wait
                ready = max(ready, prior["finished_at"].timestamp())
            lease = r["started_at"].timestamp()
            queued = bisect.bisect_right(flood_admitted, ready) - bisect.bisect_right(
                flood_leased, ready
            )
            # Itself, admitted and not leased at `ready` (unless leased at that very moment).
            own = 1 if r["created_at"].timestamp() <= ready < lease else 0
            if queued < FLOOD_BACKLOG or waiting(tenant, ready) > own:
                continue
            ahead = flood_leases(ready, lease)
            overtaken.append(ahead)
            waits.append(max(0.0, lease - ready))
            if ahead > QUIET_WAIT_BOUND:
                found["quiet_runs_waiting_past_bound"].append(
                    f"{r['run_id']} ({tenant}): {ahead} flood runs leased in its"
                    f" {lease - ready:.2f} s wait, {queued} queued when it could be leased"
                )
    if flood and not waits:
        found["flood_without_quiet_runs_measured"].append(
            f"no quiet tenant's run became leasable while {FLOOD_BACKLOG}+ flood runs were queued"
        )
    flood_waits = [
        r["started_at"].timestamp() - r["created_at"].timestamp()
        for r in flood
        if r["started_at"] is not None
    ]
    return {
        "bound_flood_leases": QUIET_WAIT_BOUND,
        "backlog_at_least": FLOOD_BACKLOG,
        "quiet_runs_measured": len(waits),
        "quiet_flood_leases_in_wait": _spread([float(n) for n in overtaken]),
        "quiet_wait_s": _spread(waits),
        "flood_runs": len(flood),
        "flood_wait_s": _spread(flood_waits),
    }


def _spread(samples: Sequence[float]) -> dict[str, float] | None:
    """p50, p99 and max of `samples`, or None when there are none."""
    if not samples:
        return None
    ordered = sorted(samples)
    return {
        "p50": round(statistics.median(ordered), 3),
        "p99": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 3),
        "max": round(ordered[-1], 3),
    }


def _channel_answers(
    state: DbState, by_id: Mapping[str, Any], seen: Seen, found: dict[str, list[str]]
) -> None:
    """Every admitted channel event is one run, answered in its thread at most once, and a
    finished channel run's answer has an outcome (a completed run's always has a record)."""
    for event_id, run_ids in seen.channel_runs.items():
        if len(run_ids) > 1:
            found["channel_runs_per_event_above_one"].append(f"{event_id}: {sorted(run_ids)}")
        if seen.channel_replies.get(event_id, 0) > 1:
            replies = seen.channel_replies[event_id]
            found["channel_events_answered_twice"].append(f"{event_id}: {replies} replies")
        for run_id in run_ids:
            status = by_id.get(run_id, {}).get("status")
            delivery = state.deliveries.get(run_id)
            if status == "completed" and delivery is None:
                found["channel_deliveries_without_outcome"].append(f"{run_id}: no record")
            elif (
                status in TERMINAL
                and delivery is not None
                and delivery["state"] not in DELIVERY_OUTCOMES
            ):
                found["channel_deliveries_without_outcome"].append(f"{run_id}: {delivery['state']}")


def _stuck(state: DbState, out: list[str]) -> int:
    """Runs not terminal that nothing will move: no live lease, no retry due to be taken, no
    pending interaction. Returns how many wait on a person (counted apart)."""
    pending_by_run: dict[str, set[str]] = defaultdict(set)
    for i in state.interactions:
        if i["status"] == "pending":
            pending_by_run[i["run_id"]].add(i["interaction_id"])
    waiting_on_person = 0
    for run in state.runs:
        status = run["status"]
        if status in TERMINAL:
            continue
        if status in WAITING:
            bound = run["waiting_interaction_id"]
            pending = pending_by_run.get(run["run_id"], set())
            if (bound in pending) if bound else bool(pending):
                waiting_on_person += 1
                continue
        elif status == "running":
            expires = run["lease_expires_at"]
            if run["lease_owner"] and expires is not None and expires > state.now:
                continue
        elif status == "retry-pending":
            due = run["next_attempt_at"]
            if due is not None and due > state.now:
                continue
        elif status == "waiting-for-timer":
            continue  # its waker moves it (one that never does is counted as lost)
        elif status == "waiting-for-children" and any(
            r.get("tree_parent_run_id") == run["run_id"] and r["status"] not in TERMINAL
            for r in state.runs
        ):
            continue  # a child of it is still on its way
        out.append(f"{run['run_id']} {status}")
    return waiting_on_person


def _duplicate_effects(records: Sequence[LedgerRecord], out: list[str]) -> None:
    """One external effect per intent: every scripted post text is unique, so two records of
    one (tenant, text), or a record without an idempotency key, is a side effect twice."""
    intents = Counter((str(r.body.get("tenant_id")), str(r.body.get("text"))) for r in records)
    for (tenant, text), n in intents.items():
        out.extend([f"{tenant}: {text!r}"] * (n - 1))
    out.extend(f"{r.id}: no idempotency key" for r in records if r.key is None)


def _lost_parts(
    state: DbState,
    by_id: Mapping[str, dict[str, Any]],
    transcripts: Mapping[str, Any],
    found: dict[str, list[str]],
) -> None:
    """For every run a client watched to its end: each stored final part reached it on the
    durable stream, as stored; nothing it was shown as persisted (a durable event, a stream's
    snapshot) is missing from storage or shorter there; and every stored event reached it.
    (The text of a part still streaming is checkpointed without an event: a client has it from
    deltas or a snapshot, so a non-final part the client never saw is not a loss.)"""
    for run_id, transcript in transcripts.items():
        if not transcript.terminal or run_id not in by_id:
            continue
        out = found["lost_persisted_parts"]
        stored = {p["part_index"]: p for p in state.parts.get(run_id, [])}
        for index, part in stored.items():
            text = part["payload"].get("text") if part["kind"] == "text" else None
            streamed = transcript.parts.get(index)
            shown = [v for v in (streamed, transcript.snapshot_parts.get(index)) if v]
            if part["final"] and streamed is None:
                out.append(f"{run_id} part {index}: final, never streamed")
            elif part["final"] and text is not None and streamed["text"] != text:
                out.append(f"{run_id} part {index}: final, streamed otherwise")
            elif any(v["text"] and not (text or "").startswith(v["text"]) for v in shown):
                out.append(f"{run_id} part {index}: stored text lost what was shown")
        for index in sorted((set(transcript.parts) | set(transcript.snapshot_parts)) - set(stored)):
            out.append(f"{run_id} part {index}: shown, not stored")
        missing = state.event_seqs.get(run_id, set()) - transcript.seqs
        found["lost_persisted_events"].extend(f"{run_id} seq {s}" for s in sorted(missing))


def _runs_per_event(state: DbState, deliveries: Mapping[str, set[str]], out: list[str]) -> None:
    """One message per inbound event, and one live run per message: a run superseded by a
    redelivery (its child in the lineage) is not counted; and the runs a client was answered
    with for one event id are one lineage."""
    events = Counter((m["tenant_id"], m["source"], m["event_id"]) for m in state.messages)
    out.extend(f"{t}/{e}: {n} messages" for (t, _, e), n in events.items() if n > 1)
    parents = {r["parent_run_id"] for r in state.runs if r["parent_run_id"]}
    heads = Counter(r["message_id"] for r in state.runs if r["run_id"] not in parents)
    out.extend(f"{m}: {n} runs" for m, n in heads.items() if n > 1)
    roots = {r["run_id"]: r["root_run_id"] for r in state.runs}
    for event_id, run_ids in deliveries.items():
        lineages = {roots.get(run_id, run_id) for run_id in run_ids}
        if len(lineages) > 1:
            out.append(f"{event_id}: answered with {len(lineages)} unrelated runs")


def _unauthorised(
    state: DbState,
    by_id: Mapping[str, dict[str, Any]],
    records: Sequence[LedgerRecord],
    out: list[str],
) -> None:
    """Every gated effect that reached the ledger has, in its run's lineage, a claimed approval
    allowing exactly that input, or a standing grant that covers the run made before it."""
    principals = {m["message_id"]: m for m in state.messages}
    for record in records:
        run = by_id.get(str(record.body.get("run_id")))
        if run is None:
            out.append(f"{record.id}: run {record.body.get('run_id')!r} unknown")
            continue
        lineage = {r["run_id"] for r in state.runs if r["root_run_id"] == run["root_run_id"]}
        text = record.body.get("text")
        claimed = any(
            i["kind"] == "approval"
            and i["run_id"] in lineage
            and i["status"] == "claimed"
            and i["decision"] in ALLOWING
            and i["tool_name"] == record.body.get("tool")
            and (i["input"] or {}).get("text") == text
            for i in state.interactions
        )
        received = datetime.fromisoformat(record.received_at)
        granted = any(
            _covers(g, run, principals.get(run["message_id"]), str(record.body.get("tool")))
            and g["created_at"] <= received + CLOCK_SLACK
            for g in state.grants
        )
        if not (claimed or granted):
            out.append(f"{record.id}: {record.body.get('tool')} {text!r} in {run['run_id']}")


def _covers(
    grant: Mapping[str, Any], run: Mapping[str, Any], message: Mapping[str, Any] | None, tool: str
) -> bool:
    if grant["tenant_id"] != run["tenant_id"]:
        return False
    scope = grant["scope"]
    if scope == "category":
        return bool(grant["risk_category"]) and grant["risk_category"] == "publish"
    if grant["tool_name"] != tool:
        return False
    if scope == "tenant":
        return True
    if scope == "conversation":
        return bool(grant["session_id"] == run["session_id"])
    if scope == "principal":
        return message is not None and grant["principal_id"] == message.get("actor_id")
    return False
