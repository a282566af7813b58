"""PostgreSQL's CPU by who asked for it: each backend's CPU (/proc/<pid>/stat) under the
application_name its client gave (`tether.db.engine.application_name`: tether-admission,
tether-orchestrator, tether-orchestrator-claims, ...), the server's own processes under their
backend type (checkpointer, walwriter, ...), and what neither holds (the postmaster, and
backends that ended within the window) as the rest of the server's total."""

from __future__ import annotations

from collections import defaultdict

import asyncpg

from bench.cpu import cpu_s

_WHO = (
    "SELECT pid, CASE WHEN backend_type = 'client backend' THEN application_name "
    "ELSE backend_type END FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
)
ENDED = "ended or unnamed"

Sample = dict[int, tuple[str, float]]


async def sample(db_url: str) -> Sample:
    """Each of the server's processes now: who it serves, and its CPU seconds so far."""
    db = await asyncpg.connect(db_url, server_settings={"application_name": "bench"})
    try:
        rows = await db.fetch(_WHO)
    finally:
        await db.close()
    return {pid: (who or ENDED, cpu_s(pid)) for pid, who in rows}


def by_application(before: Sample, after: Sample, server_s: float) -> dict[str, float]:
    """CPU seconds between two samples by who the processes served; a process that started
    between them counts from 0. `server_s`: the whole server's CPU over the same window
    (bench.cpu.tree_cpu_s of the postmaster), whose share no live process holds is `ENDED`."""
    used: dict[str, float] = defaultdict(float)
    for pid, (who, seconds) in after.items():
        start = before.get(pid)
        used[who] += seconds - (start[1] if start is not None and start[0] == who else 0.0)
    used[ENDED] += max(server_s - sum(used.values()), 0.0)
    return {who: seconds for who, seconds in used.items() if seconds > 0 or who == ENDED}
