"""Counters per completed run over a saturated phase, read at the servers: PostgreSQL
statements (its statement log) and transactions (pg_stat_database), WAL bytes, gRPC calls and
stream messages between the processes (bench.grpc_tap) and Redis commands (INFO commandstats).

The stage's services run behind counting taps and PostgreSQL logs every statement: both slow
the stack, so nothing here is a speed. The phase is COUNTED_RUNS one-turn runs from SUBMITTERS
concurrent callers, each its own conversation, done when every run's terminal event has come
through Redis (the bench reads nothing from the database during the phase).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from typing import Any

import asyncpg
import redis.asyncio as redis

from bench import wal_floor
from bench.common import Servers, emit
from bench.counters import StatementLog, pg_counters, redis_calls, wal_bytes
from bench.grpc_tap import UNKNOWN, TappedServiceSet
from bench.hotpath_stage import Stage, server_log, stage, top
from bench.model import PROMPT, Model
from bench.runs import SUBMITTERS, WORKER_CONCURRENCY, WORKERS, Completions
from bench.runs import completions as terminal_events
from tether.db import schema

COUNTED_RUNS = 600  # per-run counts steady to the second decimal; the background weighs little
# Runs before the count: every backend that serves the phase has read the new log settings
# (a backend reloads before its next command) and the services' caches are warm.
WARMUP_RUNS = 32
# PostgreSQL 16 backends flush their statistics at most once a second and, once idle, within
# PGSTAT_IDLE_INTERVAL (10 s): waiting this long makes pg_stat_database whole.
STATS_FLUSH_S = 11.0
PHASE_TIMEOUT_S = 300.0
TOP_SHAPES = 15


async def counters(servers: Servers, model: Model) -> None:
    """Count one saturated phase; emit the per-run counters."""
    admin = await asyncpg.connect(servers.server_url)  # the `postgres` database, not counted
    log = StatementLog(admin, server_log(servers), frozenset(schema.metadata.tables))
    redis_client = redis.Redis.from_url(servers.redis_url)
    try:
        async with (
            stage(servers, model, kind=TappedServiceSet) as current,
            terminal_events(servers.redis_url) as done,
        ):
            await log.enable()
            try:
                await _count(current, done, log, admin, redis_client)
            finally:
                await log.disable()
    finally:
        await redis_client.aclose()
        await admin.close()


async def batch(current: Stage, done: Completions, runs: int) -> tuple[Counter[str], list[str]]:
    """Admit `runs` one-turn runs from SUBMITTERS callers and wait for every terminal event;
    how they ended, and the runs that completed."""
    tag = uuid.uuid4().hex[:8]
    pending = iter(range(runs))
    run_ids: list[str] = []

    async def submitter() -> None:
        for i in pending:
            conversation = f"count-{tag}-{i}"
            sent = await current.client.send(
                PROMPT, conversation_id=conversation, event_id=conversation
            )
            run_ids.append(sent.run.run_id)

    async with asyncio.timeout(PHASE_TIMEOUT_S):
        await asyncio.gather(*(submitter() for _ in range(SUBMITTERS)))
        endings = await asyncio.gather(*(done.ending(r) for r in run_ids))
    completed = [
        r for r, (_, outcome) in zip(run_ids, endings, strict=True) if outcome == "completed"
    ]
    return Counter(outcome for _, outcome in endings), completed


async def _count(
    current: Stage,
    done: Completions,
    log: StatementLog,
    admin: asyncpg.Connection,
    redis_client: redis.Redis,
) -> None:
    services = current.services
    assert isinstance(services, TappedServiceSet)
    await batch(current, done, WARMUP_RUNS)
    # WAL right after a checkpoint carries a full image of each page first touched: start
    # every count right after one, so the images weigh the same in every invocation.
    await admin.execute("CHECKPOINT")
    await asyncio.sleep(STATS_FLUSH_S)  # the warm-up's transactions reach pg_stat_database

    pg_before = await pg_counters(admin, current.database)
    redis_before = await redis_calls(redis_client)
    rpc_before = services.rpc_counts()
    start_mark = await log.mark("start")
    started = time.perf_counter()
    outcomes, completed_runs = await batch(current, done, COUNTED_RUNS)
    seconds = time.perf_counter() - started
    end_mark = await log.mark("end")
    rpc = services.rpc_counts() - rpc_before
    redis_delta = await redis_calls(redis_client) - redis_before
    redis_delta["info"] -= 1  # the bench's own reading before the phase
    pg_after = await pg_counters(admin, current.database)

    await asyncio.sleep(STATS_FLUSH_S)  # the phase's transactions reach pg_stat_database
    pg_flushed = await pg_counters(admin, current.database)
    flushed_mark = await log.mark("flushed")
    statements = log.between(current.database, start_mark, end_mark)
    tail = log.between(current.database, end_mark, flushed_mark)

    completed = outcomes.get("completed", 0)
    if not completed:
        raise RuntimeError(f"no run completed in the counted phase: {dict(outcomes)}")
    phase: dict[str, Any] = {
        "runs": COUNTED_RUNS,
        "completed": completed,
        "outcomes": dict(outcomes),
        "workers": WORKERS,
        "worker_concurrency": WORKER_CONCURRENCY,
        "submitters": SUBMITTERS,
        "seconds": round(seconds, 3),
    }
    if completed != COUNTED_RUNS:
        phase["warning"] = f"{COUNTED_RUNS - completed} runs did not complete"

    emit(
        "pg_statements_per_run",
        len(statements.texts) / completed,
        "statements/run",
        statements=len(statements.texts),
        by_kind=top(dict(statements.by_kind), completed, limit=50),
        by_shape=top(dict(statements.by_shape), completed, limit=TOP_SHAPES),
        shapes=len(statements.by_shape),
        multi_statement_messages=statements.multi_statement,
        errors=statements.errors,
        measured="log_statement = 'all' on the bench's own server during this phase only "
        "(ALTER SYSTEM + reload); the log messages of the bench database's sessions between "
        "two marker statements the bench runs on another database: every statement the "
        "services ran (simple and extended protocol, BEGIN and COMMIT included), none of the "
        "bench's; a shape is the first keyword and the tables named",
        **phase,
    )
    xacts = pg_flushed.xacts - pg_before.xacts - tail.transactions
    emit(
        "pg_xacts_per_run",
        xacts / completed,
        "transactions/run",
        xacts=xacts,
        xact_commit=pg_flushed.xact_commit - pg_before.xact_commit,
        xact_rollback=pg_flushed.xact_rollback - pg_before.xact_rollback,
        after_the_phase_subtracted=tail.transactions,
        from_the_log_per_run=round(statements.transactions / completed, 3),
        connections_opened=pg_flushed.sessions - pg_before.sessions,
        measured=f"pg_stat_database xact_commit + xact_rollback of the bench database, read "
        f"before the phase and {STATS_FLUSH_S:.0f} s after it (backends flush their counts "
        "late), less the transactions the log shows in those seconds; from_the_log: distinct "
        "virtual transaction ids in the phase's statement log, which has no line for the "
        "transaction a new connection's start makes (connections_opened: pg_stat_database "
        "sessions, over the same seconds)",
        **phase,
    )
    written = await wal_bytes(admin, pg_before, pg_after)
    floor = await wal_floor.append_only(admin, current.db_url, current.database, completed_runs)
    emit(
        "wal_bytes_per_run",
        written / completed,
        "bytes/run",
        wal_bytes=written,
        append_only_floor_bytes_per_run=round(floor.per_run, 1),
        wal_records_per_run=round((pg_flushed.wal_records - pg_before.wal_records) / completed, 3),
        wal_fpi_per_run=round((pg_flushed.wal_fpi - pg_before.wal_fpi) / completed, 3),
        measured="pg_wal_lsn_diff of pg_current_wal_lsn() after and before the phase (the whole "
        "server: only this stage's database is busy); records and full-page images from "
        "pg_stat_wal, flushed like the transactions (the quiet seconds after included); the "
        "phase starts right after a CHECKPOINT; the append-only floor: wal_floor_bytes_per_run",
        **phase,
    )
    emit(
        "wal_floor_bytes_per_run",
        floor.per_run,
        "bytes/run",
        wal_bytes=floor.bytes,
        runs=floor.runs,
        rows_per_run=floor.rows_per_run,
        meaning="the WAL of the counted phase's own rows written again once each, in their "
        "final state, into copies of their tables with every index, two transactions per run "
        "(admission, then the rest): what the records a run keeps cost before any move of "
        "its state (bench.wal_floor)",
    )
    units = rpc.units()
    emit(
        "rpc_calls_per_run",
        sum(units.values()) / completed,
        "calls/run",
        by_method=top(dict(units), completed, limit=50),
        calls=sum(rpc.calls.values()),
        request_messages=sum(rpc.requests.values()),
        response_messages=sum(rpc.responses.values()),
        unknown_method_calls=rpc.calls[UNKNOWN],
        measured="counting taps (TCP relays reading the HTTP/2 frames) in front of every "
        "service: a unary call counts once, a streaming call each message either way; the "
        "bench's own calls to the gateway (SendMessage) are included, its Redis subscription "
        "is not gRPC",
        **phase,
    )
    commands = +redis_delta
    emit(
        "redis_ops_per_run",
        sum(commands.values()) / completed,
        "commands/run",
        by_command=top(dict(commands), completed, limit=50),
        commands=sum(commands.values()),
        measured="INFO commandstats calls, after less before the phase, less the bench's one "
        "reading; the bench's pattern subscription was made before the phase (deliveries to "
        "subscribers are not commands)",
        **phase,
    )
