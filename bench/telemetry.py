"""Telemetry's cost: saturated throughput with every service exporting its traces and metrics
over OTLP, against the same stack with telemetry off, measured in the same invocation.

Two stacks of the runs group's shape (orchestrator, admission, interactions, gateway, two
workers) on one PostgreSQL server, each with its own database and its own Redis (pub/sub
channels are server-wide: one stack's wake-ups would make the other's dispatcher look), one
with `OTEL_EXPORTER_OTLP_ENDPOINT` naming a collector process. Saturated blocks come in
pairs, off, on, on, off, off, on, ... so a drift in the machine's speed through the bench hits
both alike; the figure is the ratio of their summed rates, with every block's rate printed
beside it.

Beside it, its floor (`telemetry_span_floor_vs_off`): what the spans alone must cost with every
run sampled, whatever else telemetry does. The CPU per span as the services record them
(`tether.telemetry.recorder`: started and ended with six attributes through the batch
processor, then encoded and serialised for OTLP as their exporter does), measured in this
process, times the spans per run the collector received, added to the machine's CPU per run with
telemetry off (both cores over the off rate): off's CPU over that. The OpenTelemetry SDK's own
CPU per span is printed beside it.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from bench.common import BenchStack, Servers, bench_database, bench_servers, emit, service_set
from bench.model import Model, model_server
from bench.runs import POLL_S, SERVICES, WORKERS, saturate, worker_env
from tether import credentials
from tether.client import TetherClient
from tether.stack.embedded import EmbeddedRedis

SPAN_SAMPLES = 4096  # spans timed for the floor
WARM_RUNS = 50
BLOCKS = 4  # of each, in the order `block_order` gives
BLOCK_RUNS = 600
EXPORT_MS = 1000  # a batch of spans and the metrics every second, as a deployment might


@dataclass
class Received:
    """What the collector process said it received, once it has stopped."""

    span_batches: int = 0
    metric_batches: int = 0
    spans: int = 0
    said: list[str] = field(default_factory=list)


@asynccontextmanager
async def collector_process() -> AsyncIterator[tuple[str, Received]]:
    """`python -m tether.testing.collector --port 0`: its endpoint, and (after exit) its counts."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tether.testing.collector",
        "--port",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    received = Received()
    try:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
        if not line.startswith("collector listening "):
            raise RuntimeError(f"collector did not start: {line!r}")
        yield line.split()[-1], received
    finally:
        if process.returncode is None:
            process.terminate()
        _, err = await process.communicate()
        received.said = err.decode(errors="replace").splitlines()[-1:]
        counts = re.search(
            r"received (\d+) span batches, (\d+) metric batches, (\d+) spans", err.decode()
        )
        if counts:
            received.span_batches, received.metric_batches, received.spans = map(
                int, counts.groups()
            )


@asynccontextmanager
async def _stack(
    servers: Servers, name: str, redis_url: str, model: Model, env: dict[str, str]
) -> AsyncIterator[tuple[BenchStack, TetherClient]]:
    """The runs group's stack and workers on a database of its own, every process with `env`."""
    async with bench_database(servers.server_url) as (db_url, key):
        service_credentials = credentials.generate()
        run_dir = servers.scratch / f"run-telemetry-{name}"
        services = service_set(run_dir, db_url, redis_url, service_credentials, env)
        try:
            await services.start_all(SERVICES)
            for _ in range(WORKERS):
                await services.start("worker", extra_env=worker_env(model) | env)
            stack = BenchStack(services, db_url, redis_url, service_credentials, key)
            async with TetherClient(services.addresses()["gateway"], key) as client:
                yield stack, client
        finally:
            await services.stop_all()


def span_cpu_us(*, sdk: bool = False) -> float:
    """CPU per span, in this process: started and ended with six attributes through the batch
    processor, then encoded and serialised for OTLP as the exporter does; as the services
    record spans (`tether.telemetry.recorder`), or with `sdk` as the OpenTelemetry SDK does."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from tether.telemetry import recorder

    ended: list[Any] = []

    class Keep(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            ended.extend(spans)
            return SpanExportResult.SUCCESS

    resource = Resource.create({"service.name": "tether-bench"})
    provider: Any
    encode: Any  # the spans as the request their exporter sends
    if sdk:
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(
            BatchSpanProcessor(Keep(), SPAN_SAMPLES, schedule_delay_millis=60_000)
        )
        encode = encode_spans
    else:
        provider = recorder.RecordingTracerProvider(resource, Keep(), max_queue_size=SPAN_SAMPLES)
        encode = recorder.RecordedSpanExporter(resource)._translate_data
    tracer = provider.get_tracer("bench")
    attributes = {
        "tether.run.id": "run_0123456789abcdef0123456789abcdef",
        "tether.tenant.id": "bench",
        "tether.attempt": 1,
        "tether.lease.epoch": 2,
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "claude-sonnet-5-5",
    }

    def spans(count: int) -> float:
        ended.clear()
        started = time.thread_time()
        for _ in range(count):
            tracer.start_span("tether.bench", attributes=attributes).end()
        provider.force_flush()
        if len(ended) != count:  # a span the queue dropped would go uncounted
            raise RuntimeError(f"{count - len(ended)} of {count} spans were dropped")
        encode(ended).SerializeToString()
        return time.thread_time() - started

    spans(SPAN_SAMPLES // 16)  # warm: the first spans pay for what they load
    used = spans(SPAN_SAMPLES)
    provider.shutdown()
    return used * 1e6 / SPAN_SAMPLES


def block_order(blocks: int) -> list[str]:
    """`blocks` of each stack, paired as off, on, on, off, ...: a drift in the machine's speed
    through the bench (a slower last block, say) weighs on both alike, which off, on, off, on
    would not (its last block is always on)."""
    order: list[str] = []
    for pair in range(blocks):
        order += ["off", "on"] if pair % 2 == 0 else ["on", "off"]
    return order


async def run() -> None:
    """Print telemetry_on_vs_off and e2e_runs_per_s_telemetry_on."""
    rates: dict[str, list[float]] = {"off": [], "on": []}
    async with AsyncExitStack() as exits:
        model = await exits.enter_async_context(model_server())
        servers = await exits.enter_async_context(bench_servers())
        endpoint, received = await exits.enter_async_context(collector_process())
        own_redis = EmbeddedRedis(servers.scratch / "redis-telemetry-on")
        on_redis = await own_redis.start()
        exits.callback(own_redis.stop)
        otel = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": str(EXPORT_MS),
            "OTEL_TRACES_SAMPLER": "parentbased_always_on",  # every run sampled: the goal's terms
            "OTEL_METRIC_EXPORT_INTERVAL": str(EXPORT_MS),
        }
        chosen = {"off": (servers.redis_url, {}), "on": (on_redis, otel)}
        stacks = {
            name: await exits.enter_async_context(_stack(servers, name, url, model, env))
            for name, (url, env) in chosen.items()
        }
        for stack, client in stacks.values():  # warm both: first runs pay for imports
            await saturate(stack.db_url, client, runs=WARM_RUNS, poll_s=POLL_S)
        for name in block_order(BLOCKS):
            stack, client = stacks[name]
            result = await saturate(stack.db_url, client, runs=BLOCK_RUNS, poll_s=POLL_S)
            if result.completed != BLOCK_RUNS:
                raise RuntimeError(f"telemetry {name}: {result.statuses} of {BLOCK_RUNS}")
            rates[name].append(result.per_s)
    if received.span_batches == 0:
        raise RuntimeError(f"the collector received no spans: telemetry was not on ({received})")
    off, on = sum(rates["off"]) / BLOCKS, sum(rates["on"]) / BLOCKS
    spans_per_run = received.spans / (WARM_RUNS + BLOCKS * BLOCK_RUNS)
    per_span_us, sdk_per_span_us = span_cpu_us(), span_cpu_us(sdk=True)
    cpu_ms_off = (os.cpu_count() or 1) * 1000 / off
    span_floor = cpu_ms_off / (cpu_ms_off + spans_per_run * per_span_us / 1000)
    config = {
        "blocks": BLOCKS,
        "runs_per_block": BLOCK_RUNS,
        "rates_off": [round(r, 1) for r in rates["off"]],
        "rates_on": [round(r, 1) for r in rates["on"]],
        "export_ms": EXPORT_MS,
        "collector_span_batches": received.span_batches,
        "collector_metric_batches": received.metric_batches,
    }
    emit("e2e_runs_per_s_telemetry_off", off, "runs/s", **config)
    emit("e2e_runs_per_s_telemetry_on", on, "runs/s", **config)
    emit("telemetry_on_vs_off", on / off, "ratio", goal=">= 0.95", **config)
    emit(
        "telemetry_span_floor_vs_off",
        span_floor,
        "ratio",
        spans_per_run=round(spans_per_run, 2),
        cpu_us_per_span=round(per_span_us, 1),
        sdk_cpu_us_per_span=round(sdk_per_span_us, 1),
        cpu_ms_per_run_off=round(cpu_ms_off, 3),
        meaning="the most telemetry_on_vs_off can be with every run sampled: the CPU of the "
        "spans a run has, recorded and encoded as the services do, added to the machine's CPU "
        "per run with telemetry off (sdk_cpu_us_per_span: the OpenTelemetry SDK's own, which "
        "the services used before)",
    )
