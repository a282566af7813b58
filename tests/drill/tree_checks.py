"""The drill's invariants of run trees and timers (issue 33), beside `checker`'s: no child active
once its tree's root ended, no timer fired more often than it was set, none left unfired well
past its due time."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

TERMINAL = ("completed", "failed", "cancelled")
# A timer this far past its due time and still not fired was lost (the waker looks at least
# every TETHER_ORCHESTRATOR_RETRY_POLL_S, 10 s by default, on every replica).
TIMER_LOST_AFTER = timedelta(seconds=30)


def trees_and_timers(
    state: Any, by_id: Mapping[str, dict[str, Any]], found: dict[str, list[str]]
) -> None:
    """No child active once its tree's root ended; no timer fired more often than it was set;
    none left unfired well past its due time."""
    for run in state.runs:
        root = by_id.get(run.get("tree_root_run_id") or "")
        if root is not None and run["status"] not in TERMINAL and root["status"] in TERMINAL:
            found["children_active_after_root_ended"].append(
                f"{run['run_id']} {run['status']} (root {root['run_id']} {root['status']})"
            )
        counts = state.timer_events.get(run["run_id"], Counter())
        if counts["timer.fired"] > counts["timer.set"]:
            found["timers_fired_twice"].append(
                f"{run['run_id']}: set {counts['timer.set']}, fired {counts['timer.fired']}"
            )
        due = run.get("next_wake_at")
        if run["status"] == "waiting-for-timer" and (
            due is None or due < state.now - TIMER_LOST_AFTER
        ):
            found["timers_lost"].append(f"{run['run_id']} due {due}")


def tree_and_timer_counts(state: Any) -> dict[str, int]:
    """How much of the soak's load was trees and timers: child runs, and timers set and fired."""
    children = [r for r in state.runs if r.get("tree_parent_run_id")]
    totals: Counter[str] = Counter()
    for counts in state.timer_events.values():
        totals.update(counts)
    return {
        "children": len(children),
        "children_completed": sum(1 for r in children if r["status"] == "completed"),
        "timers_set": totals["timer.set"],
        "timers_fired": totals["timer.fired"],
    }
