"""`make bench [BENCH=group]`: prints one JSON object per line per figure."""

from __future__ import annotations

import asyncio
import sys

from bench import (
    admission,
    agents,
    channels,
    context,
    fairness,
    hotpath,
    peers,
    ratelimit,
    runs,
    stream,
    telemetry,
    tool_input,
    tools,
    trees,
    wal_relations,
)

# A group is one or more benches run in turn; `runs` ends with telemetry's cost (its own stacks).
GROUPS = {
    "admission": (admission.run,),
    "agents": (agents.run,),
    "channels": (channels.run,),
    "context": (context.run,),
    # Issue 32's four figures: fair shares and a hot tenant's wait, then the model rate limits.
    "fairness": (fairness.run, ratelimit.run),
    "hotpath": (hotpath.run,),
    # Issue 34: Tether beside pgqueuer and procrastinate, the same model call (its own lock).
    "peers": (peers.run,),
    "ratelimit": (ratelimit.run,),
    "runs": (runs.run, telemetry.run),
    # The pushed lease's cost alone (issue 34), also printed by `runs`.
    "claims": (runs.run_claim_cost,),
    "stream": (stream.run,),
    "tool_input": (tool_input.run,),
    "tools": (tools.run,),
    # Issue 33's two figures: a delegation's overhead and the timers' lateness.
    "trees": (trees.run,),
    # Issue 34: where wal_bytes_per_run goes, by relation and record kind.
    "wal": (wal_relations.run,),
}


def main() -> None:
    """Run the named groups, or all."""
    names = sys.argv[1:] or list(GROUPS)
    unknown = [n for n in names if n not in GROUPS]
    if unknown:
        sys.exit(f"unknown bench group(s) {unknown}; known: {sorted(GROUPS)}")
    for name in names:
        for bench in GROUPS[name]:
            asyncio.run(bench())


if __name__ == "__main__":
    main()
