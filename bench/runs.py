"""Run figures: end-to-end throughput and latency of runs against a local model, the runtime's
per-turn overhead over a bare SDK call, and the checkpoint cost deep into a conversation.

One stack (orchestrator, admission, interactions, gateway) on a fresh database. The checkpoint
figure comes first, with no worker running (the bench holds the leases itself); then two workers
start against a local model server (a separate process, so the bench's own load does not slow
its answers) for the latency figures at light load and, last, the saturated throughput.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import redis.asyncio as redis
from anthropic import AsyncAnthropic
from sqlalchemy import Table

from bench.common import BenchStack, bench_stack, emit, percentile
from bench.floors import FLOOR_EACH_RUN, floor_load
from bench.model import BENCH_REQUEST, MODEL, PROMPT, Model, model_server, streamed_call
from tether.client import TetherClient
from tether.db import schema
from tether.hints import EVENTS_PATTERN, decode_events
from tether.runtime.rpc import internal_channel
from tether.testing.model_script import newest_text
from tether.v1 import common_pb2, events_pb2, orchestrator_pb2, orchestrator_pb2_grpc

SERVICES = ("orchestrator", "admission", "interactions", "gateway")
WORKERS = 2
WORKER_CONCURRENCY = 8  # the worker default

THROUGHPUT_RUNS = 2000
SUBMITTERS = 16
POLL_S = 0.02
THROUGHPUT_TIMEOUT_S = 150.0

LATENCY_RUNS = 200
BARE_CALLS = 200
MULTI_TURN_K = 8  # model turns per run: K - 1 tool turns, then the answer (default max_steps)
MULTI_TURN_PAIRS = 30
RUN_TIMEOUT_S = 30.0

HISTORY_TURNS = 500  # the measured run is this turn of its conversation
CHECKPOINTS = 200
CHECKPOINT_WARMUP = 20
CLAIM_LEASES = 50  # pushed leases measured per depth

TERMINAL = {"run.completed": "completed", "run.failed": "failed", "run.cancelled": "cancelled"}


def worker_env(model: Model) -> dict[str, str]:
    """What a bench worker runs with: the local model, the default concurrency."""
    return {
        "TETHER_WORKER_ANTHROPIC_BASE_URL": model.base_url,
        "TETHER_WORKER_ANTHROPIC_API_KEY": "bench",
        "TETHER_WORKER_CONCURRENCY": str(WORKER_CONCURRENCY),
    }


# -- completion as clients observe it: the terminal event on Redis ------------------------------


@dataclass
class Completions:
    """Terminal events of every run, from one pattern subscription (`tether:events:*`)."""

    seen: dict[str, tuple[float, str]] = field(default_factory=dict)
    waiters: dict[str, asyncio.Future[tuple[float, str]]] = field(default_factory=dict)

    def record(self, raw: bytes) -> None:
        for message in decode_events(raw):
            outcome = TERMINAL.get(message.type)
            if outcome is None:
                continue
            run_id = message.run_id
            self.seen[run_id] = (time.perf_counter(), outcome)
            waiter = self.waiters.pop(run_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(self.seen[run_id])

    async def wait(self, run_id: str) -> tuple[float, str]:
        """(perf_counter when the terminal event arrived, outcome) of `run_id`, within
        RUN_TIMEOUT_S."""
        return await asyncio.wait_for(self.ending(run_id), RUN_TIMEOUT_S)

    async def ending(self, run_id: str) -> tuple[float, str]:
        """As `wait`, however long it takes."""
        if run_id in self.seen:
            return self.seen[run_id]
        waiter = self.waiters[run_id] = asyncio.get_running_loop().create_future()
        return await waiter


@contextlib.asynccontextmanager
async def completions(redis_url: str) -> AsyncIterator[Completions]:
    """Subscribed (confirmed) before yielding, so no terminal event can be missed."""
    client = redis.Redis.from_url(redis_url)
    pubsub = client.pubsub()
    await pubsub.psubscribe(EVENTS_PATTERN)
    while (await pubsub.get_message(timeout=5.0)) is None:
        pass  # the psubscribe confirmation
    state = Completions()

    async def listen() -> None:
        async for message in pubsub.listen():
            if message["type"] == "pmessage":
                state.record(message["data"])

    listener = asyncio.create_task(listen())
    try:
        yield state
    finally:
        listener.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await listener
        await pubsub.aclose()
        await client.aclose()


# -- checkpoint cost at turn 1 and deep into a conversation -------------------------------------


def clone_sql(table: Table, key: str, overrides: dict[str, str], source: str | None = None) -> str:
    """INSERT ... SELECT copying `table`'s rows (or those of `source`, a table of the same
    columns) where `key` = $1 once per g in 1..$2."""
    columns = [c.name for c in table.columns if c.identity is None]
    exprs = [overrides.get(c, f"t.{c}") for c in columns]
    return (
        f"INSERT INTO {table.name} ({', '.join(columns)}) "
        f"SELECT {', '.join(exprs)} FROM {source or table.name} t, generate_series(1, $2::int) g "
        f"WHERE t.{key} = $1"
    )


async def _clone_turns(db_url: str, run_id: str, copies: int, *, analyze: bool = True) -> None:
    """Give the run's conversation `copies` more earlier completed turns, copies of `run_id`
    (its message, run row, parts, events, usage and attempts) with older timestamps; then
    ANALYZE, unless told not to (the caller does once it has cloned every conversation)."""
    new_run = "t.run_id || '-h' || g"
    conn = await asyncpg.connect(db_url)
    try:
        async with conn.transaction():
            message_id = await conn.fetchval(
                "SELECT message_id FROM runs WHERE run_id = $1", run_id
            )
            await conn.execute(
                clone_sql(
                    schema.messages,
                    "message_id",
                    {
                        "message_id": "t.message_id || '-h' || g",
                        "event_id": "t.event_id || '-h' || g",
                        "created_at": "t.created_at - g * interval '1 second'",
                    },
                ),
                message_id,
                copies,
            )
            await conn.execute(
                clone_sql(
                    schema.runs,
                    "run_id",
                    {
                        "run_id": new_run,
                        "root_run_id": new_run,
                        "message_id": "t.message_id || '-h' || g",
                        "created_at": "t.created_at - g * interval '1 second'",
                    },
                ),
                run_id,
                copies,
            )
            for table in (schema.run_parts, schema.run_events, schema.usage_turns, schema.attempts):
                await conn.execute(clone_sql(table, "run_id", {"run_id": new_run}), run_id, copies)
        if analyze:
            await conn.execute("ANALYZE")
    finally:
        await conn.close()


def _text_batch(
    run_id: str, epoch: int, index: int, text: str
) -> orchestrator_pb2.CheckpointRequest:
    """A typical checkpoint: a finished text block (part.added, part.updated) and its turn."""
    part = common_pb2.Part(index=index, role="assistant", final=True)
    part.text.text = text
    added = events_pb2.RunEvent(type="part.added")
    added.part_added.part.CopyFrom(part)
    updated = events_pb2.RunEvent(type="part.updated")
    updated.part_updated.part.CopyFrom(part)
    return orchestrator_pb2.CheckpointRequest(
        run_id=run_id,
        epoch=epoch,
        parts=[orchestrator_pb2.PartWrite(part=part)],
        events=[added, updated],
        turns=[common_pb2.Usage(model=MODEL, input_tokens=1200, output_tokens=40)],
    )


async def _claim(
    stub: orchestrator_pb2_grpc.OrchestratorServiceStub,
) -> tuple[orchestrator_pb2.ClaimRunResponse, float]:
    start = time.perf_counter()
    claim = await stub.ClaimRun(
        orchestrator_pb2.ClaimRunRequest(worker_id="bench-checkpoints", wait_ms=5000)
    )
    if not claim.claimed:
        raise RuntimeError("nothing to claim")
    return claim, (time.perf_counter() - start) * 1000


async def _complete(
    stub: orchestrator_pb2_grpc.OrchestratorServiceStub, lease: orchestrator_pb2.Lease
) -> None:
    await stub.CompleteRun(
        orchestrator_pb2.CompleteRunRequest(
            run_id=lease.run_id,
            epoch=lease.epoch,
            status=common_pb2.RUN_STATUS_COMPLETED,
            result_text="done",
        )
    )


async def checkpoint_cost(stack: BenchStack, client: TetherClient) -> None:
    """Checkpoint RPC latency on a conversation's first turn and on its HISTORY_TURNS-th."""
    tag = uuid.uuid4().hex[:8]
    channel = internal_channel(
        stack.services.addresses()["orchestrator"], stack.credentials["worker"]
    )
    stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
    deep, fresh = f"ckpt-deep-{tag}", f"ckpt-fresh-{tag}"
    try:
        # One real earlier turn (claimed, checkpointed, completed), copied into the history.
        await client.send(PROMPT, conversation_id=deep, event_id=f"{deep}-0")
        first, _ = await _claim(stub)
        for i in range(3):
            await stub.Checkpoint(
                _text_batch(first.lease.run_id, first.lease.epoch, i, f"earlier answer {i}")
            )
        await _complete(stub, first.lease)
        await _clone_turns(stack.db_url, first.lease.run_id, HISTORY_TURNS - 2)

        sent = {
            conv: (await client.send(PROMPT, conversation_id=conv, event_id=f"{conv}-x")).run.run_id
            for conv in (deep, fresh)
        }
        claims: dict[str, orchestrator_pb2.ClaimRunResponse] = {}
        claim_ms: dict[str, float] = {}
        for _ in sent:
            claim, ms = await _claim(stub)
            conv = next(c for c, r in sent.items() if r == claim.lease.run_id)
            claims[conv], claim_ms[conv] = claim, ms
        samples: dict[str, list[float]] = {deep: [], fresh: []}
        for i in range(CHECKPOINT_WARMUP + CHECKPOINTS):
            for conv in (fresh, deep):  # interleaved, so drift hits both alike
                lease = claims[conv].lease
                request = _text_batch(lease.run_id, lease.epoch, i, f"answer {i} " * 20)
                start = time.perf_counter()
                await stub.Checkpoint(request)
                if i >= CHECKPOINT_WARMUP:
                    samples[conv].append((time.perf_counter() - start) * 1000)
        for claim in claims.values():
            await _complete(stub, claim.lease)
    finally:
        await channel.close()
    t1, t500 = statistics.median(samples[fresh]), statistics.median(samples[deep])
    emit(
        "checkpoint_cost_ratio_t500_t1",
        t500 / t1,
        "ratio",
        median_ms_t1=round(t1, 3),
        median_ms_t500=round(t500, 3),
        p99_ms_t1=round(percentile(samples[fresh], 99), 3),
        p99_ms_t500=round(percentile(samples[deep], 99), 3),
        checkpoints=CHECKPOINTS,
        batch="1 final text part + part.added + part.updated + 1 usage turn",
        prior_turns_t500=HISTORY_TURNS - 1,
        history="1 real completed run (3 parts) + SQL copies of it",
        claim_ms_t1=round(claim_ms[fresh], 3),
        claim_ms_t500=round(claim_ms[deep], 3),
        claimed_history_parts_t500=len(claims[deep].history),
        goal="<= 1.5",
    )


# -- a pushed lease's cost at turn 1 and deep into a conversation ------------------------------


async def _first_requests(model: Model, texts: set[str]) -> dict[str, tuple[float, dict[str, Any]]]:
    """The first request whose newest user text is one of `texts`, by that text: when the model
    server received it (its clock, time.time()) and its body."""
    async with model.http.get(f"{model.base_url}/_requests") as response:
        response.raise_for_status()
        log = (await response.json())["requests"]
    first: dict[str, tuple[float, dict[str, Any]]] = {}
    for record in log:
        body = record["body"]
        users = [m for m in body.get("messages", ()) if m.get("role") == "user"]
        text = newest_text(users[-1].get("content")) if users else ""
        if text in texts and text not in first:
            first[text] = (record["timestamp"], body)
    return first


async def _bare_request_ms(
    model: Model, bodies: dict[str, dict[str, Any]], rounds: int
) -> dict[str, list[float]]:
    """ms from a bare SDK call's start to the model server's answer beginning (its headers),
    for each body by label, `rounds` of each interleaved: what the same model request costs
    without the runtime, the floor under a lease's growth with the history it carries."""
    sdk = AsyncAnthropic(base_url=model.base_url, api_key="x", max_retries=0)
    samples: dict[str, list[float]] = {label: [] for label in bodies}
    try:
        for _ in range(rounds + 5):  # the first five warm the connection up
            for label, body in bodies.items():
                request = {k: v for k, v in body.items() if k != "stream"}
                start = time.perf_counter()
                stream = await sdk.messages.create(**request, stream=True)
                samples[label].append((time.perf_counter() - start) * 1000)
                async for _event in stream:
                    pass
    finally:
        await sdk.close()
    return {label: ms[5:] for label, ms in samples.items()}


async def _lease_taken_at(db: asyncpg.Connection, run_ids: list[str]) -> dict[str, float]:
    """When each run's first lease was taken: its attempt row's started_at, the claim
    statement's now() (the database's clock, the machine's: the server runs here)."""
    rows = await db.fetch(
        "SELECT run_id, extract(epoch FROM started_at)::float8 AS at FROM attempts "
        "WHERE run_id = ANY($1) AND attempt = 1",
        run_ids,
    )
    return {row["run_id"]: row["at"] for row in rows}


async def claim_cost(
    stack: BenchStack, client: TetherClient, done: Completions, model: Model
) -> None:
    """ms from a pushed lease being taken to its worker's first model request, one worker
    running: on a conversation's first turn (t1), on turn HISTORY_TURNS of a conversation the
    worker never saw (cold: it gets the whole history) and on the turn after (warm: it ran the
    turn before), CLAIM_LEASES of each, interleaved so drift hits all three alike."""
    tag = uuid.uuid4().hex[:8]
    deep = [f"claim-deep-{tag}-{i}" for i in range(CLAIM_LEASES)]
    for conv in deep:
        text = f"bench claim {conv} turn 1"
        run_id = (await client.send(text, conversation_id=conv, event_id=f"{conv}-1")).run.run_id
        _, outcome = await done.wait(run_id)
        if outcome != "completed":
            raise RuntimeError(f"the first turn of {conv} ended {outcome}")
        await _clone_turns(stack.db_url, run_id, HISTORY_TURNS - 2, analyze=False)
    db = await asyncpg.connect(stack.db_url)
    try:
        await db.execute("ANALYZE")
        texts: dict[str, dict[str, str]] = {"t1": {}, "cold": {}, "warm": {}}
        for i, conv in enumerate(deep):
            turns = (
                ("t1", f"claim-fresh-{tag}-{i}", 1),
                ("cold", conv, HISTORY_TURNS),
                ("warm", conv, HISTORY_TURNS + 1),
            )
            for label, conversation, turn in turns:
                text = f"bench claim {conversation} turn {turn}"
                event_id = f"{conversation}-t{turn}"
                sent = await client.send(text, conversation_id=conversation, event_id=event_id)
                _, outcome = await done.wait(sent.run.run_id)
                if outcome != "completed":
                    raise RuntimeError(f"{text!r} ended {outcome}")
                texts[label][sent.run.run_id] = text
        every = {run_id for by in texts.values() for run_id in by}
        taken = await _lease_taken_at(db, list(every))
        parts = await db.fetchval(
            "SELECT count(*) FROM run_parts p JOIN runs r USING (run_id) "
            "JOIN runs w ON w.session_id = r.session_id AND w.run_id = $1 "
            "WHERE r.status = 'completed' AND r.run_id <> $1",
            next(iter(texts["warm"])),
        )
    finally:
        await db.close()
    asked = await _first_requests(model, {t for by in texts.values() for t in by.values()})
    ms = {
        label: [(asked[text][0] - taken[run_id]) * 1000 for run_id, text in by.items()]
        for label, by in texts.items()
    }
    t1, cold, warm = (statistics.median(ms[k]) for k in ("t1", "cold", "warm"))
    last = {label: asked[next(reversed(by.values()))][1] for label, by in texts.items()}
    bare = await _bare_request_ms(model, {"t1": last["t1"], "t500": last["warm"]}, CLAIM_LEASES)
    bare_t1, bare_t500 = statistics.median(bare["t1"]), statistics.median(bare["t500"])
    emit(
        "claim_cost_ratio_t500_t1",
        warm / t1,
        "ratio",
        method=f"median over {CLAIM_LEASES} pushed leases per depth of ms from the lease taken "
        "(the claim statement's now()) to the worker's first model request (the model server's "
        "clock), one worker; warm: the worker ran the conversation's turn before",
        median_ms_t1=round(t1, 3),
        median_ms_t500_warm=round(warm, 3),
        median_ms_t500_cold=round(cold, 3),
        cold_ratio_t500_t1=round(cold / t1, 3),
        p90_ms_t1=round(percentile(ms["t1"], 90), 3),
        p90_ms_t500_warm=round(percentile(ms["warm"], 90), 3),
        p90_ms_t500_cold=round(percentile(ms["cold"], 90), 3),
        leases_per_depth=CLAIM_LEASES,
        prior_turns_t500=HISTORY_TURNS - 1,
        session_parts_t500=parts,
        request_bytes_t1=len(json.dumps(last["t1"])),
        request_bytes_t500=len(json.dumps(last["warm"])),
        bare_sdk_ms_t1=round(bare_t1, 3),
        bare_sdk_ms_t500=round(bare_t500, 3),
        floor_ratio_t500_t1=round((t1 + bare_t500 - bare_t1) / t1, 3),
        floor="t1's lease plus what the same model request at t500 costs a bare SDK call more "
        "than at t1 (start to the server's answer beginning, median of as many, interleaved): "
        "the request itself carries the history",
        goal="<= 1.5",
    )


# -- latency at light load ----------------------------------------------------------------------


async def _one_run(
    client: TetherClient, done: Completions, text: str, conversation: str
) -> tuple[float, str]:
    """(ms from just before SendMessage to the terminal event, outcome) of one run."""
    start = time.perf_counter()
    response = await client.send(text, conversation_id=conversation, event_id=conversation)
    finished, outcome = await done.wait(response.run.run_id)
    return (finished - start) * 1000, outcome


async def _bare_calls(
    sdk: AsyncAnthropic,
    model: Model,
    count: int,
    *,
    tool_use: bool,
    body: dict[str, Any] | None = None,
) -> list[float]:
    """Latency of a streamed call made straight with the SDK, fully consumed: the bench prompt
    alone, or `body` (a request a run sent, replayed as it was)."""
    key = f"bare-{uuid.uuid4().hex[:8]}"
    headers = {}
    if tool_use:
        await model.script(key, [{"kind": "tool_use", "name": "get_time", "input": {}}] * count)
        headers = {"x-tether-script": key}
    request = {k: v for k, v in (body or {}).items() if k != "stream"} or BENCH_REQUEST
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        await streamed_call(sdk, request, headers)
        samples.append((time.perf_counter() - start) * 1000)
    return samples


async def _requests_of(model: Model, key: str) -> list[dict[str, Any]]:
    """Bodies of the requests the model server saw under script key `key`, in order."""
    async with model.http.get(f"{model.base_url}/_requests") as response:
        response.raise_for_status()
        log = (await response.json())["requests"]
    return [r["body"] for r in log if r["script_key"] == key]


async def light_e2e(
    client: TetherClient, done: Completions, runs: int, *, warmup: int = 10
) -> tuple[list[float], dict[str, int]]:
    """ms from admission to the terminal event of `runs` one-turn runs, one at a time, after
    `warmup` more (connections, caches, both workers' code paths); and how they ended."""
    tag = uuid.uuid4().hex[:8]
    outcomes: dict[str, int] = {}
    for i in range(warmup):
        await _one_run(client, done, PROMPT, f"lat-warm-{tag}-{i}")
    samples = []
    for i in range(runs):
        ms, outcome = await _one_run(client, done, PROMPT, f"lat-{tag}-{i}")
        samples.append(ms)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return samples, outcomes


async def latency(client: TetherClient, done: Completions, model: Model) -> None:
    """e2e p50/p99 of one-turn runs, one at a time, and the per-turn overhead."""
    tag = uuid.uuid4().hex[:8]
    outcomes: dict[str, int] = {}

    async def run_one(text: str, conversation: str) -> float:
        ms, outcome = await _one_run(client, done, text, conversation)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        return ms

    e2e, light_outcomes = await light_e2e(client, done, LATENCY_RUNS)
    light = {"runs": LATENCY_RUNS, "workers": WORKERS, "outcomes": light_outcomes}
    emit("e2e_p50_ms", statistics.median(e2e), "ms", **light)
    emit("e2e_p99_ms", percentile(e2e, 99), "ms", **light)

    # One client for every bare call, as a worker keeps one: its connection stays open.
    sdk = AsyncAnthropic(base_url=model.base_url, api_key="x", max_retries=0)
    await _bare_calls(sdk, model, 20, tool_use=False)  # warm-up
    bare_text = statistics.median(await _bare_calls(sdk, model, BARE_CALLS, tool_use=False))
    bare_tool = statistics.median(await _bare_calls(sdk, model, BARE_CALLS, tool_use=True))

    # K-turn runs (K - 1 scripted get_time turns, then the answer) against one-turn runs of the
    # same scripted shape: the difference over K - 1 is the cost of one tool turn. The same
    # turns without the runtime: the requests a K-turn run sends for its turns 2..K (the K - 1
    # turns it has beyond a 1-turn run, with the history and tool definitions they carry),
    # captured by the model server from a warm-up run and replayed straight with the SDK,
    # answered the same way. Each pair is followed by its replay, so drift in the machine's
    # speed hits all three alike; the figure is the median over pairs.
    tool_turn = {"kind": "tool_use", "name": "get_time", "input": {}}
    answer = {"kind": "text", "text": "All done."}

    async def k_turn_run(k: int, label: str) -> tuple[str, float]:
        text = f"bench {k}-turn run {tag} {label}"
        await model.script(text, [tool_turn] * (k - 1) + [answer])
        return text, await run_one(text, f"turns-{k}-{tag}-{label}")

    sample_text, _ = await k_turn_run(MULTI_TURN_K, "capture")
    bodies = (await _requests_of(model, sample_text))[1:]
    if len(bodies) != MULTI_TURN_K - 1:
        raise RuntimeError(f"expected {MULTI_TURN_K - 1} later turns, found {len(bodies)}")
    one: list[float] = []
    many: list[float] = []
    bare_sums: list[float] = []
    overheads: list[float] = []
    outcomes.clear()
    for i in range(MULTI_TURN_PAIRS):
        _, single = await k_turn_run(1, str(i))
        _, multi = await k_turn_run(MULTI_TURN_K, str(i))
        bare = sum([(await _bare_calls(sdk, model, 1, tool_use=True, body=b))[0] for b in bodies])
        one.append(single)
        many.append(multi)
        bare_sums.append(bare)
        overheads.append((multi - single - bare) / (MULTI_TURN_K - 1))
    await sdk.close()
    per_turn = (statistics.median(many) - statistics.median(one)) / (MULTI_TURN_K - 1)
    bare_same = statistics.median(bare_sums) / (MULTI_TURN_K - 1)
    emit(
        "turn_overhead_ms",
        statistics.median(overheads),
        "ms",
        method=f"median over {MULTI_TURN_PAIRS} pairs of (e2e of a {MULTI_TURN_K}-turn run - "
        f"e2e of a 1-turn run - the {MULTI_TURN_K - 1} later turns' own requests sent straight "
        f"with the SDK right after) / {MULTI_TURN_K - 1}",
        includes="per tool turn, beyond the model call with its context: the worker's "
        "streaming, its one write-behind checkpoint (tool call, tool.started and tool result "
        "together), get_time and the context rebuild; admission, claim and completion cancel out",
        p25_ms=round(percentile(overheads, 25), 3),
        p75_ms=round(percentile(overheads, 75), 3),
        bare_call_ms_same_requests=round(bare_same, 3),
        pairs=MULTI_TURN_PAIRS,
        median_e2e_ms_1_turn=round(statistics.median(one), 3),
        median_e2e_ms_k_turns=round(statistics.median(many), 3),
        per_turn_ms=round(per_turn, 3),
        bare_call_ms_tool_use_minimal_request=round(bare_tool, 3),
        overhead_ms_vs_minimal_request=round(per_turn - bare_tool, 3),
        bare_call_ms_text=round(bare_text, 3),
        bare_calls=BARE_CALLS,
        one_turn_upper_bound_ms=round(statistics.median(e2e) - bare_text, 3),
        one_turn_upper_bound_note="e2e_p50 - bare text call: admission + claim + one turn + "
        "completion, an upper bound of the per-turn overhead",
        outcomes=dict(outcomes),
    )


# -- the floor under throughput -----------------------------------------------------------------

FLOOR_ITERATIONS = 1600  # per process


async def floor(stack: BenchStack, model: Model) -> None:
    """Runs per second that nothing of Tether's could exceed: WORKERS processes, each with
    WORKER_CONCURRENCY loops of one no-op RPC to the gateway, three minimal durable commits and
    one bare streamed SDK call (see bench.floor_load), what every durable run costs whatever
    the design. No Redis, no logic: what this reaches, on this machine, bounds
    e2e_runs_per_s from above."""
    async with floor_load(
        model.base_url,
        stack.services.addresses()["gateway"],
        stack.db_url,
        processes=WORKERS,
        iterations=FLOOR_ITERATIONS,
        concurrency=WORKER_CONCURRENCY,
    ) as load:
        result = await load.go()
    emit(
        "e2e_floor_runs_per_s",
        result.per_s,
        "runs/s",
        each_run=FLOOR_EACH_RUN,
        processes=WORKERS,
        concurrency=WORKER_CONCURRENCY,
        iterations=result.iterations,
        seconds=round(result.seconds, 3),
        cpu_ms_per_run=round((os.cpu_count() or 1) * 1000 / result.per_s, 3),
        note="an upper bound on e2e_runs_per_s on this machine: a run also needs the "
        "internal RPCs, queries, events, Redis and the logic of admission, claim and "
        "completion, none of which is in this loop",
    )


# -- throughput at saturation -------------------------------------------------------------------


@dataclass
class Saturation:
    """How a saturated batch of one-turn runs went: statuses counted in the database, wall
    seconds from the first admission to the last terminal status seen, and to the last
    admission."""

    runs: int
    statuses: dict[str, int]
    seconds: float
    admit_seconds: float

    @property
    def completed(self) -> int:
        return self.statuses.get("completed", 0)

    @property
    def per_s(self) -> float:
        return self.completed / self.seconds


async def saturate(db_url: str, client: TetherClient, *, runs: int, poll_s: float) -> Saturation:
    """Admit `runs` one-turn runs, each in its own conversation, from SUBMITTERS concurrent
    callers, and wait until all are terminal, polling the database every `poll_s`."""
    tag = uuid.uuid4().hex[:8]
    db = await asyncpg.connect(db_url, server_settings={"application_name": "bench"})
    since = await db.fetchval("SELECT clock_timestamp()")
    # The tenant's runs since by their keys (run_keys: runs has no index by tenant), each by id.
    count_sql = (
        "SELECT r.status, count(*) FROM run_keys k JOIN runs r USING (run_id) "
        "WHERE k.tenant_id = 'bench' AND k.created_at >= $1 GROUP BY r.status"
    )
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(runs):
        queue.put_nowait(i)
    admitted_at = 0.0

    async def submitter() -> None:
        nonlocal admitted_at
        while not queue.empty():
            i = queue.get_nowait()
            conversation = f"tput-{tag}-{i}"
            await client.send(PROMPT, conversation_id=conversation, event_id=conversation)
        admitted_at = time.perf_counter()

    start = time.perf_counter()
    submitters = asyncio.gather(*(submitter() for _ in range(SUBMITTERS)))
    counts: dict[str, int] = {}
    try:
        while time.perf_counter() - start < THROUGHPUT_TIMEOUT_S:
            if submitters.done():
                submitters.result()  # a failed submission fails the bench here, not later
            counts = dict(await db.fetch(count_sql, since))
            if sum(counts.get(s, 0) for s in TERMINAL.values()) >= runs:
                break
            await asyncio.sleep(poll_s)
        elapsed = time.perf_counter() - start
        await submitters
    finally:
        await db.close()
    return Saturation(runs, counts, elapsed, admitted_at - start)


async def throughput(stack: BenchStack, client: TetherClient) -> None:
    """Completed runs per second, first admit to last completion, with THROUGHPUT_RUNS runs each
    in its own conversation; completion counted straight from the database."""
    result = await saturate(stack.db_url, client, runs=THROUGHPUT_RUNS, poll_s=POLL_S)
    emit("e2e_runs_per_s", result.per_s, "runs/s", **saturation_config(result, POLL_S))


def saturation_config(result: Saturation, poll_s: float) -> dict[str, Any]:
    """What e2e_runs_per_s prints beside its value."""
    config: dict[str, Any] = {
        "runs": result.runs,
        "completed": result.completed,
        "failed": result.statuses.get("failed", 0),
        "statuses": result.statuses,
        "workers": WORKERS,
        "worker_concurrency": WORKER_CONCURRENCY,
        "submitters": SUBMITTERS,
        "seconds": round(result.seconds, 3),
        "admit_seconds": round(result.admit_seconds, 3),
        "poll_ms": poll_s * 1000,
    }
    if result.completed != result.runs:
        config["warning"] = f"{result.runs - result.completed} runs did not complete"
    return config


async def run() -> None:
    """Run the runs group."""
    async with (
        model_server() as model,
        bench_stack(SERVICES) as stack,
        TetherClient(stack.services.addresses()["gateway"], stack.api_key) as client,
    ):
        await checkpoint_cost(stack, client)
        async with completions(stack.redis_url) as done:
            # One worker first, so that a conversation's every lease goes to the same worker.
            await stack.services.start("worker", extra_env=worker_env(model))
            await claim_cost(stack, client, done, model)
            for _ in range(WORKERS - 1):
                await stack.services.start("worker", extra_env=worker_env(model))
            await latency(client, done, model)
        await throughput(stack, client)
        await floor(stack, model)


async def run_claim_cost() -> None:
    """Only the pushed lease's cost (`make bench BENCH=claims`): its own stack and one worker."""
    async with (
        model_server() as model,
        bench_stack(SERVICES) as stack,
        TetherClient(stack.services.addresses()["gateway"], stack.api_key) as client,
        completions(stack.redis_url) as done,
    ):
        await stack.services.start("worker", extra_env=worker_env(model))
        await claim_cost(stack, client, done, model)
