"""The claim's cost against the queue's depth: the same number of one-turn runs drained with
10 other runs queued behind them and with 10,000. The claim takes the oldest claimable run,
so it must stay one indexed scan however deep the queue: the drain rate should not move.

One run is admitted through the gateway while no worker runs, and its rows (session, message,
run, run.queued event) are kept aside as a template. Each block then queues, in one
transaction, SQL copies of it (as bench.runs copies a conversation's history), each its own
conversation heading its session: the measured runs, the oldest of the queue, and the backlog
behind them. The workers, running throughout, drain them; a block is timed by the database's
own timestamps, first claim (started_at) to last completion (finished_at) of its measured
runs. What is left of the backlog is then cancelled (a bare status change: those runs are
nobody's) and vacuumed out of the claim's index, and the next block starts on an idle stack.
Blocks alternate between the two depths, so drift in the machine's speed hits both alike.
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

CLAIM_QUEUES = (10, 10_000)
CLAIM_RUNS = 500  # measured per block: several seconds drained by 16 slots
CLAIM_ROUNDS = 3  # blocks per depth, alternating
# Blocks are timed by the database's timestamps, so polling for their end only bounds the
# wait; the poll reads the measured runs by primary key: the same cost at either depth.
CLAIM_POLL_S = 0.25
CLAIM_TIMEOUT_S = 180.0
ENDED = [s.value for s in TERMINAL]
COPIED = (schema.sessions, schema.messages, schema.runs, schema.run_events)


@dataclass
class Depth:
    """The measured blocks at one depth, pooled."""

    queued_behind: int
    completed: int = 0
    seconds: float = 0.0

    @property
    def per_s(self) -> float:
        return self.completed / self.seconds


async def claim_cost(current: Stage) -> None:
    """Drain CLAIM_RUNS runs with each of CLAIM_QUEUES runs queued behind them, in
    alternating blocks."""
    conn = await asyncpg.connect(current.db_url)
    try:
        template = await _template(current, conn)
        depths = [Depth(behind) for behind in CLAIM_QUEUES]
        for _ in range(CLAIM_ROUNDS):
            for depth in depths:
                completed, seconds = await _block(conn, template, depth.queued_behind)
                depth.completed += completed
                depth.seconds += seconds
    finally:
        await conn.close()
    shallow, deep = depths
    emit(
        f"claim_cost_ratio_q{deep.queued_behind}_q{shallow.queued_behind}",
        deep.per_s / shallow.per_s,
        "ratio",
        meaning=f"throughput with {deep.queued_behind} runs queued behind over throughput with "
        f"{shallow.queued_behind} (drain rate at q{deep.queued_behind} over drain rate at "
        f"q{shallow.queued_behind}): 1 when the claim's cost does not grow with the queue, "
        "less when it does",
        runs_per_s={f"q{d.queued_behind}": round(d.per_s, 3) for d in depths},
        seconds={f"q{d.queued_behind}": round(d.seconds, 3) for d in depths},
        completed={f"q{d.queued_behind}": d.completed for d in depths},
        measured_runs_per_block=CLAIM_RUNS,
        blocks_per_depth=CLAIM_ROUNDS,
        workers=WORKERS,
        worker_concurrency=WORKER_CONCURRENCY,
        seeding="SQL copies of one admitted run (session, message, run, run.queued), then "
        "ANALYZE; the measured runs are the queue's oldest; blocks alternate between depths",
        timing="first started_at to last finished_at of each block's measured runs",
    )


async def _template(current: Stage, conn: asyncpg.Connection) -> str:
    """Admit one run with the workers stopped and keep its rows in `claim_template_*` tables;
    its run id. The workers run again on return."""
    for name in current.workers():
        await current.services.stop(name)
    conversation = f"claim-{uuid.uuid4().hex[:8]}"
    sent = await current.client.send(PROMPT, conversation_id=conversation, event_id=conversation)
    run_id = sent.run.run_id
    row = await conn.fetchrow(
        "SELECT session_id, message_id, status FROM runs WHERE run_id = $1", run_id
    )
    if row is None or row["status"] != RunStatus.QUEUED.value:
        raise RuntimeError(f"the template run {run_id} is not queued")
    keys = {"session_id": row["session_id"], "message_id": row["message_id"], "run_id": run_id}
    for table in COPIED:
        key = _key(table.name)
        await conn.execute(
            f"CREATE TABLE claim_template_{table.name} AS "
            f"SELECT * FROM {table.name} WHERE {key} = $1",
            keys[key],
        )
    await current.add_workers(WORKERS)
    return run_id


def _key(table: str) -> str:
    return {"sessions": "session_id", "messages": "message_id"}.get(table, "run_id")


async def _block(conn: asyncpg.Connection, template: str, behind: int) -> tuple[int, float]:
    """Queue CLAIM_RUNS runs and `behind` younger ones, wait for the first to end, clear the
    rest away; (completed, seconds) of the measured runs."""
    tag = uuid.uuid4().hex[:8]
    keys = await conn.fetchrow(
        "SELECT session_id, message_id FROM claim_template_runs WHERE run_id = $1", template
    )
    assert keys is not None
    values = {"session_id": keys["session_id"], "message_id": keys["message_id"]}
    values["run_id"] = template
    async with conn.transaction():
        await _copies(conn, values, f"m{tag}", CLAIM_RUNS, "2 hours")
        await _copies(conn, values, f"b{tag}", behind, "1 hour")
    await conn.execute("ANALYZE runs")  # as autovacuum would have, after a gradual growth
    measured = [f"{template}-m{tag}-{g}" for g in range(1, CLAIM_RUNS + 1)]
    deadline = time.monotonic() + CLAIM_TIMEOUT_S
    while True:
        row = await conn.fetchrow(
            "SELECT count(*) FILTER (WHERE status = ANY($2::text[])) AS ended, "
            "count(*) FILTER (WHERE status = 'completed') AS completed, "
            "min(started_at) AS first, max(finished_at) AS last "
            "FROM runs WHERE run_id = ANY($1::text[])",
            measured,
            ENDED,
        )
        assert row is not None
        if row["ended"] == len(measured):
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(measured) - row['ended']} measured runs did not end")
        await asyncio.sleep(CLAIM_POLL_S)
    await _clear(conn, f"{template}-b{tag}-%", deadline)
    return row["completed"], (row["last"] - row["first"]).total_seconds()


async def _copies(
    conn: asyncpg.Connection, keys: dict[str, str], label: str, copies: int, age: str
) -> None:
    """`copies` copies of the template run, each in its own new session, created `age` ago
    (a microsecond apart, in order)."""
    suffix = f"'-{label}-' || g"
    at = f"now() - interval '{age}' + g * interval '1 microsecond'"
    new = {c: f"t.{c} || {suffix}" for c in ("session_id", "message_id", "run_id")}
    overrides = {
        "sessions": {
            "session_id": new["session_id"],
            "conversation_id": f"t.conversation_id || {suffix}",
            "active_run_id": f"t.active_run_id || {suffix}",
            "created_at": at,
        },
        "messages": {
            "message_id": new["message_id"],
            "session_id": new["session_id"],
            "event_id": f"t.event_id || {suffix}",
            "created_at": at,
        },
        "runs": {
            "run_id": new["run_id"],
            "root_run_id": f"t.root_run_id || {suffix}",
            "session_id": new["session_id"],
            "message_id": new["message_id"],
            "conversation_id": f"t.conversation_id || {suffix}",
            "created_at": at,
            "updated_at": at,
        },
        "run_events": {"run_id": new["run_id"], "created_at": at},
    }
    for table in COPIED:
        key = _key(table.name)
        sql = clone_sql(table, key, overrides[table.name], f"claim_template_{table.name}")
        await conn.execute(sql, keys[key], copies)


async def _clear(conn: asyncpg.Connection, backlog: str, deadline: float) -> None:
    """Take the backlog runs (`backlog`: a LIKE pattern of their ids) still queued out of the
    queue, vacuum them away, and wait until no run is in flight."""
    await conn.execute(
        "UPDATE runs SET status = $2 WHERE run_id LIKE $1 AND status = $3",
        backlog,
        RunStatus.CANCELLED.value,
        RunStatus.QUEUED.value,
    )
    # The claim's index would otherwise carry the dead entries into the next block.
    await conn.execute("VACUUM ANALYZE runs")
    in_flight = "SELECT count(*) FROM runs WHERE NOT status = ANY($1::text[])"
    while await conn.fetchval(in_flight, ENDED):
        if time.monotonic() > deadline:
            raise TimeoutError("runs still in flight after the block")
        await asyncio.sleep(CLAIM_POLL_S)
