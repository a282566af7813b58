"""The telemetry pieces that need no process: the trace context as text, bounded labels, what
the instruments record, and the log lines."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import TraceFlags

from tether import telemetry
from tether.telemetry import metrics, tracing
from tether.telemetry.logs import JsonFormatter, TextFormatter, bind_run, bound_run

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_a_traceparent_is_read_and_written_back_unchanged() -> None:
    parsed = tracing.parse(TRACEPARENT)
    assert parsed is not None and parsed.is_remote
    assert parsed.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    assert parsed.trace_flags == TraceFlags.SAMPLED
    assert tracing.traceparent_of(parsed) == TRACEPARENT


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",  # no flags
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # zero trace id
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # zero span id
        "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # forbidden version
        "00-0af7651916cd43dd8448eb211c80319-b7ad6b7169203331-01",  # short trace id
        "00-0af7651916cd43dd8448eb211c80319z-b7ad6b7169203331-01",  # not hex
    ],
)
def test_what_is_not_a_traceparent_is_no_parent(bad: str) -> None:
    assert tracing.parse(bad) is None


def test_a_run_stored_without_a_context_still_has_one_trace() -> None:
    root = tracing.run_root("run_abc")
    assert root == tracing.run_root("run_abc"), "the same for every span of the run"
    assert root.trace_id != tracing.run_root("run_abd").trace_id
    assert root.is_valid and root.trace_flags.sampled


@pytest.fixture
def reader() -> Iterator[InMemoryMetricReader]:
    reading = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reading])
    metrics.start(provider.get_meter("test"), tenants=["acme", " beta "])
    yield reading
    provider.shutdown()


def points(reader: InMemoryMetricReader, name: str) -> list[tuple[dict[str, object], float]]:
    data = reader.get_metrics_data()
    found = []
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == name:
                    for point in metric.data.data_points:
                        value = getattr(point, "value", None)
                        found.append((dict(point.attributes or {}), value or point.count))
    return found


def test_only_allow_listed_tenants_are_labels(reader: InMemoryMetricReader) -> None:
    for tenant in ("acme", "beta", "someone", "someone-else"):
        metrics.run_moved("completed", tenant)
    counted = {a["tether.tenant"]: v for a, v in points(reader, "tether.runs")}
    assert counted == {"acme": 1, "beta": 1, "other": 2}


def test_models_and_error_codes_are_labels_only_while_they_look_like_ids(
    reader: InMemoryMetricReader,
) -> None:
    metrics.retry("provider_overloaded", "acme")
    metrics.retry("Something <odd> the provider said" * 3, "acme")
    assert {a["error.type"] for a, _ in points(reader, "tether.retries")} == {
        "provider_overloaded",
        "other",
    }


def test_a_turn_counts_its_tokens_by_type_and_its_cost(reader: InMemoryMetricReader) -> None:
    usage = {
        "input_tokens": 10,
        "output_tokens": 5,
        "cache_creation_input_tokens": 3,
        "cache_read_input_tokens": 0,
    }
    metrics.model_turn("acme", "claude-sonnet-4-5", usage, 42)
    tokens = {a["gen_ai.token.type"]: v for a, v in points(reader, "tether.tokens")}
    assert tokens == {"input": 10, "output": 5, "cache_creation": 3}
    ((labels, cost),) = points(reader, "tether.cost")
    assert cost == 42 and labels["gen_ai.request.model"] == "claude-sonnet-4-5"


def test_stage_durations_are_histograms_in_seconds(reader: InMemoryMetricReader) -> None:
    metrics.stages(
        {"context_ms": 2.0, "attempt_ms": 150.0, "finalisation_ms": 1.0, "total_ms": 160.0}
    )
    metrics.claimed(0.5, 3.0, "acme")
    stages = {a["tether.stage"]: n for a, n in points(reader, "tether.stage.duration")}
    assert stages == {"context": 1, "attempt": 1, "finalisation": 1, "total": 1, "routing": 1}


def test_the_queue_gauges_report_the_last_reading(reader: InMemoryMetricReader) -> None:
    report = metrics.observe_queue()
    assert points(reader, "tether.queue.depth") == [], "nothing before the first reading"
    report(7, 12.5)
    assert points(reader, "tether.queue.depth")[0][1] == 7
    assert points(reader, "tether.queue.oldest_age")[0][1] >= 12.5


def formatted(formatter: logging.Formatter, message: str, *, exc: bool = False) -> str:
    logger = logging.getLogger("tether.test")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    logger.addHandler(handler)
    try:
        if exc:
            try:
                raise ValueError("boom")
            except ValueError:
                logger.exception(message)
        else:
            logger.warning(message)
    finally:
        logger.removeHandler(handler)
    return stream.getvalue()


def test_a_log_line_names_the_run_its_task_is_about() -> None:
    async def attempt() -> str:
        bind_run("run_1", "acme", 2, TRACEPARENT)
        return formatted(JsonFormatter("worker"), "tool crashed", exc=True)

    line = json.loads(asyncio.run(attempt()))
    assert line["service"] == "worker" and line["level"] == "ERROR"
    assert (line["run_id"], line["tenant_id"], line["attempt"]) == ("run_1", "acme", 2)
    assert line["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert "ValueError: boom" in line["exception"]
    assert bound_run() is None, "the binding stayed in the task that made it"
    assert "run_id" not in json.loads(formatted(JsonFormatter("worker"), "idle"))


def test_while_on_a_line_carries_the_current_span() -> None:
    provider = TracerProvider()
    tracer = provider.get_tracer("test")
    telemetry.on = True
    try:
        with tracer.start_as_current_span("work") as span:
            line = json.loads(formatted(JsonFormatter("orchestrator"), "hello"))
    finally:
        telemetry.on = False
    assert line["span_id"] == f"{span.get_span_context().span_id:016x}"
    assert line["trace_id"] == f"{span.get_span_context().trace_id:032x}"


def test_the_text_form_is_one_readable_line() -> None:
    async def attempt() -> str:
        bind_run("run_9")
        return formatted(TextFormatter("worker"), "stalled")

    text = asyncio.run(attempt())
    assert text.rstrip().endswith("worker WARNING tether.test: stalled [run run_9]")
