"""The claim's cost against the queue's depth: the same number of one-turn runs drained with
10 other runs queued behind them and with 10,000. The claim takes the oldest claimable run,
so it must stay one indexed scan however deep the queue: the drain rate should not move.

Each case: the workers stop, one run is admitted through the gateway (it stays queued), and
SQL copies of it (its session, message, run and run.queued event, as bench.runs copies a
conversation's history) make the measured runs, the oldest of the queue, and the backlog
behind them, each its own conversation heading its session. The workers start again; the rate
is measured from the database's own timestamps, first claim (started_at) to last completion
(finished_at) of the measured runs, so the workers' start is not in it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import asyncpg

from bench.common import emit
from bench.hotpath_stage import Stage
from bench.model import PROMPT
from bench.runs import WORKER_CONCURRENCY, WORKERS, clone_sql
from tether.db import schema
from tether.states import TERMINAL, RunStatus

CLAIM_RUNS = 1000  # measured per case: about 10 s drained by 16 slots, long against the ramps
CLAIM_QUEUES = (10, 10_000)
# The drain is timed by the database's timestamps, so polling for its end only bounds the
# wait; its query reads the measured runs by primary key, the same cost in both cases.
CLAIM_POLL_S = 0.25
CLAIM_TIMEOUT_S = 180.0
ENDED = [s.value for s in TERMINAL]


@dataclass
class Drain:
    """How the measured runs of one case went."""

    queued_behind: int
    completed: int
    seconds: float

    @property
    def per_s(self) -> float:
        return self.completed / self.seconds


async def claim_cost(current: Stage) -> None:
    """Drain CLAIM_RUNS runs with each of CLAIM_QUEUES runs queued behind them."""
    drains = []
    for behind in CLAIM_QUEUES:
        for name in current.workers():
            await current.services.stop(name)
        measured = await _seed(current, behind)
        await current.add_workers(WORKERS)
        last = behind == CLAIM_QUEUES[-1]
        drains.append(await _drain(current.db_url, measured, behind, wait_for_all=not last))
    shallow, deep = drains
    emit(
        f"claim_cost_ratio_q{deep.queued_behind}_q{shallow.queued_behind}",
        shallow.per_s / deep.per_s,
        "ratio",
        meaning=f"time per run with {deep.queued_behind} runs queued behind over time per run "
        f"with {shallow.queued_behind} (drain rate at q{shallow.queued_behind} over drain "
        f"rate at q{deep.queued_behind})",
        runs_per_s={f"q{d.queued_behind}": round(d.per_s, 3) for d in drains},
        seconds={f"q{d.queued_behind}": round(d.seconds, 3) for d in drains},
        completed={f"q{d.queued_behind}": d.completed for d in drains},
        measured_runs=CLAIM_RUNS,
        workers=WORKERS,
        worker_concurrency=WORKER_CONCURRENCY,
        seeding="SQL copies of one admitted run (session, message, run, run.queued), then "
        "ANALYZE; the measured runs are the queue's oldest",
        timing="first started_at to last finished_at of the measured runs",
    )


async def _seed(current: Stage, behind: int) -> list[str]:
    """Queue CLAIM_RUNS runs and `behind` younger ones; the ids of the first."""
    tag = uuid.uuid4().hex[:8]
    conversation = f"claim-{tag}"
    sent = await current.client.send(PROMPT, conversation_id=conversation, event_id=conversation)
    template = sent.run.run_id
    conn = await asyncpg.connect(current.db_url)
    try:
        async with conn.transaction():
            row = await conn.fetchrow(
                "SELECT session_id, message_id FROM runs WHERE run_id = $1 AND status = $2",
                template,
                RunStatus.QUEUED.value,
            )
            if row is None:
                raise RuntimeError(f"the template run {template} is not queued")
            keys = {"session_id": row["session_id"], "message_id": row["message_id"]}
            await _copies(conn, template, keys, f"m{tag}", CLAIM_RUNS, "2 hours")
            await _copies(conn, template, keys, f"b{tag}", behind, "1 hour")
        await conn.execute("ANALYZE runs")  # as autovacuum would have, after a gradual growth
    finally:
        await conn.close()
    return [f"{template}-m{tag}-{g}" for g in range(1, CLAIM_RUNS + 1)]


async def _copies(
    conn: asyncpg.Connection,
    run_id: str,
    keys: dict[str, str],
    label: str,
    copies: int,
    age: str,
) -> None:
    """`copies` copies of queued run `run_id`, each in its own new session, created `age` ago
    (a microsecond apart, in order)."""
    suffix = f"'-{label}-' || g"
    at = f"now() - interval '{age}' + g * interval '1 microsecond'"
    new = {c: f"t.{c} || {suffix}" for c in ("session_id", "message_id", "run_id")}
    plans = [
        (
            schema.sessions,
            "session_id",
            keys["session_id"],
            {
                "session_id": new["session_id"],
                "conversation_id": f"t.conversation_id || {suffix}",
                "active_run_id": f"t.active_run_id || {suffix}",
                "created_at": at,
            },
        ),
        (
            schema.messages,
            "message_id",
            keys["message_id"],
            {
                "message_id": new["message_id"],
                "session_id": new["session_id"],
                "event_id": f"t.event_id || {suffix}",
                "created_at": at,
            },
        ),
        (
            schema.runs,
            "run_id",
            run_id,
            {
                "run_id": new["run_id"],
                "root_run_id": f"t.root_run_id || {suffix}",
                "session_id": new["session_id"],
                "message_id": new["message_id"],
                "conversation_id": f"t.conversation_id || {suffix}",
                "created_at": at,
                "updated_at": at,
            },
        ),
        (schema.run_events, "run_id", run_id, {"run_id": new["run_id"], "created_at": at}),
    ]
    for table, key, value, overrides in plans:
        await conn.execute(clone_sql(table, key, overrides), value, copies)


async def _drain(db_url: str, run_ids: list[str], behind: int, *, wait_for_all: bool) -> Drain:
    """Wait until the measured runs have ended (and, with `wait_for_all`, every run of the
    database, so the next case starts on an empty queue); time them by their timestamps."""
    conn = await asyncpg.connect(db_url)
    deadline = time.monotonic() + CLAIM_TIMEOUT_S
    try:
        while True:
            row = await conn.fetchrow(
                "SELECT count(*) FILTER (WHERE status = ANY($2::text[])) AS ended, "
                "count(*) FILTER (WHERE status = 'completed') AS completed, "
                "min(started_at) AS first, max(finished_at) AS last "
                "FROM runs WHERE run_id = ANY($1::text[])",
                run_ids,
                ENDED,
            )
            assert row is not None
            if row["ended"] == len(run_ids):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(run_ids) - row['ended']} measured runs did not end")
            await asyncio.sleep(CLAIM_POLL_S)
        while wait_for_all and await conn.fetchval(
            "SELECT count(*) FROM runs WHERE NOT status = ANY($1::text[])", ENDED
        ):
            if time.monotonic() > deadline:
                raise TimeoutError("the backlog did not drain")
            await asyncio.sleep(CLAIM_POLL_S)
    finally:
        await conn.close()
    return Drain(behind, row["completed"], (row["last"] - row["first"]).total_seconds())
