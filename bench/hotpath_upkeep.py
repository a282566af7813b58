"""What a running run costs PostgreSQL while it runs: WAL per lease renewal (a worker's keepalive
renews every lease it holds in one statement), per checkpoint (a batch of one part and its
event), and per character of a long answer streamed through the whole stack, counted at the
server.

A one-turn run in the counters phase never renews or checkpoints; an agent run that works for
minutes does both many times, so these two counters, not the per-run one, say what a long run
writes. LEASES runs are leased to one worker through the orchestrator's own claim; then ROUNDS
keepalives renew all of them, each in its own transaction as the Work stream sends them, then
each run takes CHECKPOINTS checkpoints. Each phase starts after a CHECKPOINT and one round of
warm-up, so the full-page images the first touch of a page writes after a checkpoint weigh the
same every time; whether each row update was HOT (no new index entries) is read in the same
transaction (pg_stat_get_xact_tuples_hot_updated).

The streamed answer: ANSWER_CHARS characters in deltas of DELTA_CHARS, DELTA_MS apart (as a
model streams a long answer, slower here only by the model's pace), through the gateway, one
worker and the orchestrator; the worker checkpoints every checkpoint_interval_s (0.25 s) as it
streams. The figure is the run's WAL from its admission to its terminal event, over the
answer's length: what storing the answer's progress costs beyond storing the answer.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote, urlsplit

import asyncpg
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from bench.common import Servers, bench_database, emit
from bench.counters import pg_counters, wal_bytes
from bench.hotpath_stage import stage
from bench.model import Model
from bench.runs import completions
from services.admission.adapters import normalise
from services.admission.domain import FreshnessPolicy
from services.admission.service import Admitter
from services.orchestrator.execution import Execution
from services.orchestrator.repositories import leases as lease_repo
from services.orchestrator.repositories import progress
from tether.db.engine import create_engine
from tether.domain import Part, Role, Text, part_updated
from tether.v1 import admission_pb2

LEASES = 200
ROUNDS = 20
CHECKPOINTS = 10
TTL_S = 600.0  # nothing expires while the bench holds the leases
WORKER = "bench-upkeep"
ANSWER_CHARS = 24_000
DELTA_CHARS = 40
DELTA_MS = 20.0  # 600 deltas: 12 s of streaming, about 48 checkpoints
ANSWERS = 2
_UPDATES = text(
    "SELECT pg_stat_get_xact_tuples_updated('runs'::regclass) AS updated, "
    "pg_stat_get_xact_tuples_hot_updated('runs'::regclass) AS hot"
)


async def upkeep(servers: Servers) -> None:
    """Emit WAL bytes per lease renewal and per checkpoint, with the share of HOT updates."""
    async with bench_database(servers.server_url) as (db_url, _):
        engine = create_engine(db_url, pool_size=2)
        admin = await asyncpg.connect(servers.server_url)
        database = unquote(urlsplit(db_url).path.lstrip("/"))
        try:
            held = await _lease(engine)

            async def renew_all(conn: AsyncConnection, _: int) -> int:
                renewed = await lease_repo.renew(conn, held, TTL_S)
                assert len(renewed) == len(held), "a lease was lost"
                return len(renewed)

            async def checkpoint_all(conn: AsyncConnection, round_: int) -> int:
                for run_id, epoch in held:
                    part = Part(0, Role.ASSISTANT, Text("upkeep " * (round_ + 1)))
                    written = await progress.checkpoint(
                        conn, run_id, epoch, TTL_S, [part], [part_updated(part)], []
                    )
                    assert written is not None, "a lease was lost"
                return len(held)

            for figure, unit, step, rounds in (
                ("wal_bytes_per_lease_renewal", "bytes/renewal", renew_all, ROUNDS),
                ("wal_bytes_per_checkpoint", "bytes/checkpoint", checkpoint_all, CHECKPOINTS),
            ):
                written, done, hot, updated = await _count(admin, database, engine, step, rounds)
                emit(
                    figure,
                    written / done,
                    unit,
                    wal_bytes=written,
                    writes=done,
                    runs_row_updates=updated,
                    runs_row_hot_updates=hot,
                    leases=len(held),
                    rounds=rounds,
                    measured="pg_wal_lsn_diff over the rounds (each round one transaction, "
                    "after a CHECKPOINT and one warm-up round); HOT: the runs row's "
                    "version went on the same page with no new index entries "
                    "(pg_stat_get_xact_tuples_hot_updated, read in each round's transaction)",
                )
        finally:
            await admin.close()
            await engine.dispose()


async def _lease(engine: Any) -> list[tuple[str, int]]:
    """LEASES runs admitted and leased to WORKER by the orchestrator's claim: (run id, epoch)."""
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    tag = uuid.uuid4().hex[:8]
    for i in range(LEASES):
        chat = admission_pb2.ChatInput(
            event_id=f"upkeep-{tag}-{i}", conversation_id=f"upkeep-{tag}-{i}", text="upkeep"
        )
        caller = admission_pb2.Caller(tenant_id="bench", principal_id="bench")
        await admitter.admit(normalise(admission_pb2.AdmitRequest(caller=caller, chat=chat)))
    execution = Execution.build(engine, None, lease_ttl_s=TTL_S, claim_poll_s=60)
    held: list[tuple[str, int]] = []
    while len(held) < LEASES:
        claimed = await execution.claims.claim_many(WORKER, 64)
        if not claimed:
            raise RuntimeError(f"only {len(held)} of {LEASES} runs could be leased")
        held += [(c.run.run_id, c.run.lease_epoch) for c in claimed]
    return sorted(held)


async def _count(
    admin: asyncpg.Connection,
    database: str,
    engine: Any,
    step: Callable[[AsyncConnection, int], Awaitable[int]],
    rounds: int,
) -> tuple[int, int, int, int]:
    """WAL bytes, writes, HOT and all row updates of the runs table over `rounds` of `step`."""
    await admin.execute("CHECKPOINT")
    async with engine.begin() as conn:
        await step(conn, 0)  # warm-up: the pages' first images after the checkpoint
    before = await pg_counters(admin, database)
    done = hot = updated = 0
    for round_ in range(1, rounds + 1):
        async with engine.begin() as conn:
            # The backend's counts for the table grow over the transaction; read both ends.
            first = (await conn.execute(_UPDATES)).one()
            done += await step(conn, round_)
            last = (await conn.execute(_UPDATES)).one()
            hot += last.hot - first.hot
            updated += last.updated - first.updated
    after = await pg_counters(admin, database)
    return await wal_bytes(admin, before, after), done, hot, updated


async def streamed_answer(servers: Servers, model: Model) -> None:
    """Emit WAL bytes per character of a long answer streamed through the stack."""
    words = [f"w{i % 997:03d}" for i in range(ANSWER_CHARS // 5 + 1)]
    answer = " ".join(words)[:ANSWER_CHARS]
    chunks = [answer[i : i + DELTA_CHARS] for i in range(0, ANSWER_CHARS, DELTA_CHARS)]
    admin = await asyncpg.connect(servers.server_url)
    try:
        async with (
            stage(servers, model, workers=1) as current,
            completions(current.redis_url) as done,
        ):
            written: list[int] = []
            for _ in range(ANSWERS):
                tag = uuid.uuid4().hex[:8]
                prompt = f"bench: a long answer {tag}"
                turn = {"kind": "text", "text": answer, "chunks": chunks, "delay_ms": DELTA_MS}
                await model.script(prompt, [turn])
                before = await pg_counters(admin, current.database)
                sent = await current.client.send(
                    prompt, conversation_id=f"long-{tag}", event_id=f"long-{tag}"
                )
                _, outcome = await done.wait(sent.run.run_id)
                if outcome != "completed":
                    raise RuntimeError(f"the long answer's run ended {outcome}")
                after = await pg_counters(admin, current.database)
                written.append(await wal_bytes(admin, before, after))
    finally:
        await admin.close()
    emit(
        "wal_bytes_per_answer_char",
        min(written) / ANSWER_CHARS,
        "bytes/char",
        wal_bytes=written,
        answer_chars=ANSWER_CHARS,
        deltas=len(chunks),
        delta_ms=DELTA_MS,
        measured="pg_wal_lsn_diff from before the run's admission to its terminal event, the "
        "least of ANSWERS runs one at a time (nothing else writes meanwhile but the stage's "
        "own upkeep); an answer stored once weighs about 1 byte per character, twice over "
        "(its part and its event)",
    )
