"""Hot-path figures: what a run costs the stack as it stands, as counters read at the servers
and as ratios to floors measured in the same invocation (this 2-core machine's speed moves by
up to 40% between runs, so a goal is a ratio to a floor measured beside it, never an absolute).

Four stages, each on a fresh database of the same embedded PostgreSQL and Redis, with the
local model server out of process (bench.runs):

- speed: two workers; light-load latency against the floor loop run one at a time, saturated
  throughput and CPU against the floor loop saturated and against the topology floor (the same
  processes and hops doing only their hop's work: bench.topology_floor), that floor's p50 with
  Tether's own statements (records), the stack idle with 8 workers, and the claim's cost with
  10,000 runs queued against 10 (bench.hotpath_queue);
- admission: no workers; admissions through the gateway against a no-op call through two bare
  gRPC hops (bench.relay_floor);
- counters: two workers behind counting taps (bench.grpc_tap) with PostgreSQL's statement log
  on: statements, transactions, WAL (and its append-only floor: bench.wal_floor), RPCs and
  Redis commands per run (bench.hotpath_counts).
  Logging slows the server, so no speed figure comes from that stage;
- upkeep: what a running run writes while it runs, WAL per lease renewal and per checkpoint
  on a database of its own with no services, and per character of a long answer streamed
  through the stack with one worker (bench.hotpath_upkeep).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc

from bench import hotpath_counts, hotpath_queue, hotpath_upkeep, pg_users
from bench.common import Servers, bench_servers, closed_loop, emit, percentile
from bench.floors import FLOOR_EACH_RUN, floor_load
from bench.hotpath_stage import NOT_THE_STACK, Stage, cpu_meter, ms_by_role, redis_pid, stage
from bench.hotpath_topology import topology
from bench.model import Model, model_server
from bench.relay_floor import METHOD as RELAY_METHOD
from bench.runs import (
    WORKER_CONCURRENCY,
    WORKERS,
    completions,
    light_e2e,
    saturate,
    saturation_config,
)
from bench.topology_floor import EACH_RUN as TOPOLOGY_EACH_RUN
from bench.topology_floor import SEND as TOPOLOGY_SEND
from tether.v1 import gateway_pb2, gateway_pb2_grpc

# One at a time: enough for a steady p50, and a p99 that is more than the one slowest run.
LIGHT_RUNS = 200
LIGHT_BLOCKS = 4  # runs and floor iterations alternate in blocks: drift hits both alike
# At saturation (16 in flight): 20-40 s here, long against the ramps at both ends and against
# the 10 ms tick of the CPU clocks.
SATURATED_RUNS = 1000
# The load generator counts completions in the database; every 0.1 s costs little CPU and
# at most 0.1 s (under 0.5%) of the phase.
SATURATED_POLL_S = 0.1
# Per floor process at saturation: the floor loop runs about 5 times as fast as runs do, so
# this lasts about as long as SATURATED_RUNS.
FLOOR_ITERATIONS = 2400
IDLE_WORKERS = 8
IDLE_SETTLE_S = 3.0  # the new workers' first claims and connections, before the window
IDLE_WINDOW_S = 10.0  # a thousand 10 ms ticks of one core: resolution 0.1%
ADMIT_CALLERS = 16
ADMIT_OPS = 1600  # per block at 16 callers: a few seconds, a steady rate
FLOOR_OPS = 3200  # per block of the floor at 16 callers: it runs several times as fast
ADMIT_OPS_C1 = 300  # per block at one caller: a steady p50
ADMIT_ROUNDS = 2  # blocks of the admission and of its floor alternate: drift hits both alike
WARMUP_OPS = 20  # per caller, before the measured blocks: connections, caches


async def speed(servers: Servers, model: Model) -> None:
    """Light-load latency, saturated throughput and CPU, idle CPU and the claim's cost."""
    async with stage(servers, model) as current:
        light = await light_latency(servers, current)
        await saturated(servers, current, light)
        await idle(servers, current)
        await hotpath_queue.claim_cost(current)


@dataclass(frozen=True)
class Light:
    """Light-load p50s (ms), measured in alternating blocks: the run floor loop's and the
    topology floor's."""

    floor: float
    topology: float


async def light_latency(servers: Servers, current: Stage) -> Light:
    """e2e p50 of one-turn runs, one at a time, over the floor loop's own p50 one at a time;
    the topology floor's and its records' one at a time too: blocks of each alternate."""
    e2e: list[float] = []
    floor_ms: list[float] = []
    bare_ms: list[float] = []
    kept_ms: list[float] = []
    outcomes: Counter[str] = Counter()
    each = LIGHT_RUNS // LIGHT_BLOCKS
    async with (
        completions(current.redis_url) as done,
        floor_load(
            current.model.base_url,
            current.services.addresses()["gateway"],
            current.db_url,
            processes=1,
            iterations=each,
            concurrency=1,
        ) as load,
        topology(servers, current.model) as bare,
        topology(servers, current.model, records=True) as kept,
    ):
        for block in range(LIGHT_BLOCKS):
            samples, ended = await light_e2e(
                current.client, done, each, warmup=10 if block == 0 else 0
            )
            e2e += samples
            outcomes.update(ended)
            floor_ms += (await load.go()).latencies_ms
            bare_ms += (await bare.saturate(each, callers=1)).latencies_ms
            kept_ms += (await kept.saturate(each, callers=1)).latencies_ms
    p50, floor_p50 = statistics.median(e2e), statistics.median(floor_ms)
    bare_p50, kept_p50 = statistics.median(bare_ms), statistics.median(kept_ms)
    light = {"runs": len(e2e), "workers": WORKERS, "outcomes": dict(outcomes)}
    emit(
        "e2e_p50_vs_floor",
        p50 / floor_p50,
        "ratio",
        e2e_p50_ms=round(p50, 3),
        floor_p50_ms=round(floor_p50, 3),
        floor_p99_ms=round(percentile(floor_ms, 99), 3),
        floor_iterations=len(floor_ms),
        blocks=LIGHT_BLOCKS,
        measured="ms from just before SendMessage to the run's terminal event on Redis, one "
        "run at a time; the floor: its loop's iterations, one at a time; blocks of each "
        "alternate",
        floor_each_run=FLOOR_EACH_RUN,
        **light,
    )
    emit("e2e_p99_ms", percentile(e2e, 99), "ms", **light)
    emit(
        "records_floor_p50_vs_floor",
        kept_p50 / floor_p50,
        "ratio",
        records_floor_p50_ms=round(kept_p50, 3),
        topology_floor_p50_ms=round(bare_p50, 3),
        floor_p50_ms=round(floor_p50, 3),
        runs=len(kept_ms),
        blocks=LIGHT_BLOCKS,
        meaning="the light-load p50 of the topology floor whose intake and dispatcher send "
        "Tether's own statements bare (admission's, the claim, the completion: every record a "
        "one-turn run keeps), over the run floor's, in blocks alternating with the runs and the "
        "floor: what e2e_p50_vs_floor costs before any service code runs (bench.topology_floor "
        "--records). Not at saturation: the stack batches claims and completions there, the "
        "floor does not, so its CPU there would be no floor",
    )
    return Light(floor_p50, bare_p50)


async def saturated(servers: Servers, current: Stage, light: Light) -> None:
    """Completed runs per second and CPU per completed run at saturation, over the floor
    loop's, saturated the same way and measured right after; and the topology floor's, with its
    light-load p50 (measured with the runs') over the floor loop's."""
    meter = cpu_meter(servers, current, await redis_pid(servers.redis_url))
    pg_before = await pg_users.sample(current.db_url)
    before = meter.sample()
    result = await saturate(
        current.db_url, current.client, runs=SATURATED_RUNS, poll_s=SATURATED_POLL_S
    )
    used = meter.sample() - before
    pg_used = pg_users.by_application(
        pg_before, await pg_users.sample(current.db_url), used.by_role["postgres"]
    )
    async with floor_load(
        current.model.base_url,
        current.services.addresses()["gateway"],
        current.db_url,
        processes=WORKERS,
        iterations=FLOOR_ITERATIONS,
        concurrency=WORKER_CONCURRENCY,
    ) as load:
        floor_before = meter.sample()
        floor = await load.go()
        floor_used = meter.sample() - floor_before
    async with topology(servers, current.model) as bare:
        skeleton = await bare.saturate(SATURATED_RUNS)
    floor_roles = {**floor_used.by_role, "floor_load": floor.cpu_s}
    floor_cpu = floor_used.total + floor.cpu_s
    floor_cpu_ms = floor_cpu * 1000 / floor.iterations
    skeleton_cpu_ms = skeleton.used.total * 1000 / skeleton.runs
    emit(
        "e2e_vs_floor",
        result.per_s / floor.per_s,
        "ratio",
        e2e_runs_per_s=round(result.per_s, 3),
        e2e_floor_runs_per_s=round(floor.per_s, 3),
        floor_each_run=FLOOR_EACH_RUN,
        floor_processes=WORKERS,
        floor_concurrency=WORKER_CONCURRENCY,
        floor_iterations=floor.iterations,
        floor_seconds=round(floor.seconds, 3),
        **saturation_config(result, SATURATED_POLL_S),
    )
    completed = max(result.completed, 1)
    cpu_ms = used.total * 1000 / completed
    emit(
        "topology_floor_vs_floor",
        skeleton_cpu_ms / floor_cpu_ms,
        "ratio",
        topology_floor_cpu_ms_per_run=round(skeleton_cpu_ms, 3),
        floor_cpu_ms_per_iteration=round(floor_cpu_ms, 3),
        topology_floor_runs_per_s=round(skeleton.per_s, 3),
        e2e_floor_runs_per_s=round(floor.per_s, 3),
        topology_floor_cpu_ms_by_process=ms_by_role(skeleton.used.by_role, skeleton.runs),
        topology_floor_each_run=TOPOLOGY_EACH_RUN,
        topology_floor_p50_vs_floor=round(light.topology / light.floor, 3),
        topology_floor_p50_ms=round(light.topology, 3),
        floor_p50_ms=round(light.floor, 3),
        meaning="the CPU a run costs when it only crosses Tether's processes and hops "
        "(bench.topology_floor), over the run floor's: the part of cpu_vs_floor's budget the "
        "topology itself takes before the runtime does any work of its own",
    )
    emit(
        "cpu_vs_topology_floor",
        cpu_ms / skeleton_cpu_ms,
        "ratio",
        cpu_ms_per_run=round(cpu_ms, 3),
        topology_floor_cpu_ms_per_run=round(skeleton_cpu_ms, 3),
        e2e_vs_topology_floor=round(result.per_s / skeleton.per_s, 3),
        meaning="the runtime's own cost: CPU per run over the topology floor's",
    )
    emit(
        "cpu_vs_floor",
        cpu_ms / floor_cpu_ms,
        "ratio",
        cpu_ms_per_run=round(cpu_ms, 3),
        floor_cpu_ms_per_iteration=round(floor_cpu_ms, 3),
        cpu_ms_per_run_by_process=ms_by_role(used.by_role, completed),
        postgres_cpu_ms_per_run_by_application=ms_by_role(pg_used, completed),
        floor_cpu_ms_per_iteration_by_process=ms_by_role(floor_roles, floor.iterations),
        cores_busy=round(used.total / result.seconds, 3),
        floor_cores_busy=round(floor_cpu / floor.seconds, 3),
        completed=result.completed,
        measured="utime+stime from /proc/<pid>/stat over the saturated phase, of every "
        "process: the services, the workers, PostgreSQL (postmaster and backends, ended ones "
        "through the postmaster's reaped-children time), Redis, the model server and the bench "
        "(the load generator); the floor the same way over its timed loops, its own processes "
        "included. PostgreSQL's by the application_name of each backend's pool (bench.pg_users)",
    )


async def idle(servers: Servers, current: Stage) -> None:
    """CPU of the whole stack, idle, with IDLE_WORKERS worker processes."""
    extra = await current.add_workers(IDLE_WORKERS - len(current.workers()))
    meter = cpu_meter(servers, current, await redis_pid(servers.redis_url))
    await asyncio.sleep(IDLE_SETTLE_S)
    before, start = meter.sample(), time.perf_counter()
    await asyncio.sleep(IDLE_WINDOW_S)  # the quiet window itself
    used, seconds = meter.sample() - before, time.perf_counter() - start
    stack = {r: s for r, s in used.by_role.items() if r not in NOT_THE_STACK}
    others = {r: s for r, s in used.by_role.items() if r in NOT_THE_STACK}
    emit(
        "idle_cpu_pct_w8",
        sum(stack.values()) / seconds * 100,
        "% of one core",
        workers=len(current.workers()),
        seconds=round(seconds, 3),
        pct_by_process=_pct(stack, seconds),
        not_counted_pct=_pct(others, seconds),
        measured="utime+stime of the services (8 workers), PostgreSQL and Redis over a quiet "
        "window with no run in flight, after a settle",
    )
    for name in extra:
        await current.services.stop(name)


def _pct(by_role: dict[str, float], seconds: float) -> dict[str, float]:
    ordered = sorted(by_role.items(), key=lambda kv: -kv[1])
    return {role: round(cpu / seconds * 100, 3) for role, cpu in ordered}


# -- admission against two bare hops ------------------------------------------------------------


@asynccontextmanager
async def relay_floor() -> AsyncIterator[str]:
    """A backend and a relay in front of it (bench.relay_floor); yields the relay's address."""
    processes: list[asyncio.subprocess.Process] = []

    async def start(*args: str) -> str:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.relay_floor", *args, stdout=asyncio.subprocess.PIPE
        )
        processes.append(process)
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
        if not line.startswith("listening "):
            raise RuntimeError(f"relay floor {args[0]} did not start: {line!r}")
        return f"127.0.0.1:{line.split()[1]}"

    try:
        yield await start("relay", await start("backend"))
    finally:
        for process in processes:
            if process.returncode is None:
                process.terminate()
            await process.wait()


@dataclass
class Blocks:
    """Measured blocks of one kind of call, pooled."""

    ops: int = 0
    seconds: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)

    @property
    def per_s(self) -> float:
        return self.ops / self.seconds


async def admission(servers: Servers, model: Model) -> None:
    """Admissions/s through the gateway at ADMIT_CALLERS callers over a no-op call through a
    relay and a backend, blocks alternating; and one caller's p50 over the floor's."""
    names = ("orchestrator", "admission", "gateway")
    async with (
        stage(servers, model, names=names, workers=0) as current,
        relay_floor() as relay,
        grpc.aio.insecure_channel(current.services.addresses()["gateway"]) as gateway_channel,
        grpc.aio.insecure_channel(relay) as relay_channel,
        topology(servers, model, runners=0) as bare,
        grpc.aio.insecure_channel(bare.edge) as bare_channel,
        topology(servers, model, runners=0, records=True) as kept,
        grpc.aio.insecure_channel(kept.edge) as kept_channel,
    ):
        gateway = gateway_pb2_grpc.GatewayServiceStub(gateway_channel)
        call_relay = relay_channel.unary_unary(RELAY_METHOD)
        metadata = (("authorization", f"Bearer {current.api_key}"),)
        tag, sent = uuid.uuid4().hex[:8], iter(range(1 << 62))

        def request() -> gateway_pb2.SendMessageRequest:
            n = next(sent)
            return gateway_pb2.SendMessageRequest(
                event_id=f"admit-{tag}-{n}", conversation_id=f"conv-{tag}-{n}", text="bench"
            )

        async def admit(caller: int, i: int) -> None:
            await gateway.SendMessage(request(), metadata=metadata)

        # The floor carries an admission request's bytes: the same size through two hops.
        async def floor(caller: int, i: int) -> None:
            await call_relay(request().SerializeToString())

        # Two hops and a durable insert: the topology floor's way in (edge, intake: one
        # single-row insert and a wake-up), with no runner taking what it admits.
        send_bare = bare_channel.unary_unary(TOPOLOGY_SEND)

        async def durable(caller: int, i: int) -> None:
            await send_bare(request().SerializeToString())

        # The same, the intake sending admission's own statement: what admission's records
        # cost on their way in, with none of the services' code around them.
        send_kept = kept_channel.unary_unary(TOPOLOGY_SEND)

        async def records(caller: int, i: int) -> None:
            await send_kept(request().SerializeToString())

        many = await _alternate(
            {admit: ADMIT_OPS, floor: FLOOR_OPS, durable: FLOOR_OPS}, ADMIT_CALLERS
        )
        one = await _alternate(
            {
                admit: ADMIT_OPS_C1,
                floor: ADMIT_OPS_C1,
                durable: ADMIT_OPS_C1,
                records: ADMIT_OPS_C1,
            },
            1,
        )
    hops = (
        "client -> relay -> backend, each its own process on loopback, bare grpc.aio, the "
        "backend echoing an admission request's bytes"
    )
    admit_c16, floor_c16, durable_c16 = many
    emit(
        f"admit_vs_floor_c{ADMIT_CALLERS}",
        admit_c16.per_s / floor_c16.per_s,
        "ratio",
        admit_per_s=round(admit_c16.per_s, 3),
        floor_per_s=round(floor_c16.per_s, 3),
        topology_floor_per_s=round(durable_c16.per_s, 3),
        topology_floor_vs_floor=round(durable_c16.per_s / floor_c16.per_s, 3),
        topology_floor="the same two hops, the backend making one single-row autocommit insert "
        "and one Redis publish (bench.topology_floor's edge and intake)",
        admit_p50_ms=round(statistics.median(admit_c16.latencies_ms), 3),
        floor_p50_ms=round(statistics.median(floor_c16.latencies_ms), 3),
        callers=ADMIT_CALLERS,
        admissions=admit_c16.ops,
        floor_calls=floor_c16.ops,
        rounds=ADMIT_ROUNDS,
        floor=hops,
        admission="SendMessage through the gateway, a unique event in a new conversation",
    )
    admit_c1, floor_c1, durable_c1, records_c1 = one
    p50, floor_p50, durable_p50, records_p50 = (
        statistics.median(admit_c1.latencies_ms),
        statistics.median(floor_c1.latencies_ms),
        statistics.median(durable_c1.latencies_ms),
        statistics.median(records_c1.latencies_ms),
    )
    emit(
        "admit_p50_vs_floor_c1",
        p50 / floor_p50,
        "ratio",
        admit_p50_ms=round(p50, 3),
        floor_p50_ms=round(floor_p50, 3),
        admit_p99_ms=round(percentile(admit_c1.latencies_ms, 99), 3),
        floor_p99_ms=round(percentile(floor_c1.latencies_ms, 99), 3),
        topology_floor_p50_ms=round(durable_p50, 3),
        topology_floor_p50_vs_floor=round(durable_p50 / floor_p50, 3),
        records_floor_p50_ms=round(records_p50, 3),
        records_floor_p50_vs_floor=round(records_p50 / floor_p50, 3),
        records_floor="the topology floor's two hops, the intake sending admission's own "
        "statement (claim, session, message, run and its event in one round trip) on a bare "
        "driver connection, then the wake-up (bench.topology_floor --records)",
        admissions=admit_c1.ops,
        floor_calls=floor_c1.ops,
        rounds=ADMIT_ROUNDS,
        floor=hops,
    )


Op = Callable[[int, int], Awaitable[None]]


async def _alternate(per_block: dict[Op, int], callers: int) -> list[Blocks]:
    """ADMIT_ROUNDS blocks of each op (`per_block`: its calls per block), alternating, after a
    warm-up of each; their pooled blocks, in the order given."""
    for op in per_block:
        await closed_loop(op, callers=callers, ops_per_caller=WARMUP_OPS)
    pooled = {op: Blocks() for op in per_block}
    for _ in range(ADMIT_ROUNDS):
        for op, blocks in pooled.items():
            result = await closed_loop(op, callers=callers, ops_per_caller=per_block[op] // callers)
            blocks.ops += result.ops
            blocks.seconds += result.seconds
            blocks.latencies_ms.extend(result.latencies_ms)
    return list(pooled.values())


async def run() -> None:
    """Run the hotpath group."""
    async with bench_servers(embedded=True) as servers, model_server() as model:
        await speed(servers, model)
        await admission(servers, model)
        await hotpath_counts.counters(servers, model)
        await hotpath_upkeep.upkeep(servers)
        await hotpath_upkeep.streamed_answer(servers, model)
