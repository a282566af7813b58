"""A local OpenTelemetry collector: an OTLP/gRPC receiver that keeps what the services export
(spans, metric points; logs are accepted and dropped) in memory, for tests to read. Point the
services at it with `OTEL_EXPORTER_OTLP_ENDPOINT=collector.endpoint`. In process::

    async with Collector() as collector:
        ...  # services started with collector.env()
        spans = collector.spans_of_trace(trace_id)

Out of process (a receiver for `make bench` with telemetry on): `python -m
tether.testing.collector --port 0` prints `collector listening http://HOST:PORT` and counts
what it receives, keeping nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import grpc
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


@dataclass(frozen=True)
class ExportedSpan:
    """One span as a service exported it."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict[str, Any]
    links: tuple[tuple[str, str], ...]  # (trace id, span id) of each linked span
    start_ns: int
    end_ns: int


@dataclass(frozen=True)
class MetricPoint:
    """One data point of one metric: a sum's or gauge's value, or a histogram's count and sum."""

    service: str
    instance: str
    name: str
    attributes: dict[str, Any]
    value: float
    count: int = 0
    time_ns: int = 0


@dataclass
class Received:
    """Everything received so far."""

    spans: list[ExportedSpan] = field(default_factory=list)
    points: list[MetricPoint] = field(default_factory=list)
    span_batches: int = 0
    metric_batches: int = 0
    span_count: int = 0  # spans received, kept or not


def _value(value: common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind) if kind else None


def _attributes(pairs: Sequence[common_pb2.KeyValue]) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


class _Traces(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, received: Received, keep: bool) -> None:
        self._received = received
        self._keep = keep

    async def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self._received.span_batches += 1
        self._received.span_count += sum(
            len(scope.spans) for spans in request.resource_spans for scope in spans.scope_spans
        )
        if not self._keep:
            return trace_service_pb2.ExportTraceServiceResponse()
        for resource_spans in request.resource_spans:
            service = str(_attributes(resource_spans.resource.attributes).get("service.name"))
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    self._received.spans.append(
                        ExportedSpan(
                            service,
                            span.name,
                            span.trace_id.hex(),
                            span.span_id.hex(),
                            span.parent_span_id.hex(),
                            span.kind,
                            _attributes(span.attributes),
                            tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links),
                            span.start_time_unix_nano,
                            span.end_time_unix_nano,
                        )
                    )
        return trace_service_pb2.ExportTraceServiceResponse()


class _Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, received: Received, keep: bool) -> None:
        self._received = received
        self._keep = keep

    async def Export(
        self, request: metrics_service_pb2.ExportMetricsServiceRequest, context: Any
    ) -> metrics_service_pb2.ExportMetricsServiceResponse:
        self._received.metric_batches += 1
        if not self._keep:
            return metrics_service_pb2.ExportMetricsServiceResponse()
        for resource_metrics in request.resource_metrics:
            resource = _attributes(resource_metrics.resource.attributes)
            service = str(resource.get("service.name"))
            instance = str(resource.get("service.instance.id"))
            for scope in resource_metrics.scope_metrics:
                for metric in scope.metrics:
                    self._received.points.extend(_points(service, instance, metric))
        return metrics_service_pb2.ExportMetricsServiceResponse()


def _points(service: str, instance: str, metric: Any) -> list[MetricPoint]:
    kind = metric.WhichOneof("data")
    points = []
    for point in getattr(metric, kind).data_points:
        attributes = _attributes(point.attributes)
        if kind == "histogram":
            value, count = point.sum, point.count
        else:
            number = point.WhichOneof("value")
            value, count = float(getattr(point, number)), 0
        points.append(
            MetricPoint(
                service, instance, metric.name, attributes, value, count, point.time_unix_nano
            )
        )
    return points


class _Logs(logs_service_pb2_grpc.LogsServiceServicer):
    async def Export(
        self, request: logs_service_pb2.ExportLogsServiceRequest, context: Any
    ) -> logs_service_pb2.ExportLogsServiceResponse:
        return logs_service_pb2.ExportLogsServiceResponse()


class Collector:
    """The receiver; `keep=False` only counts the batches it receives."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, keep: bool = True) -> None:
        self._host = host
        self._port = port
        self._keep = keep
        self.received = Received()
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        """Bind and begin serving."""
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
        # The generated registrars are untyped.
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]
            _Traces(self.received, self._keep), server
        )
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(  # type: ignore[no-untyped-call]
            _Metrics(self.received, self._keep), server
        )
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(  # type: ignore[no-untyped-call]
            _Logs(), server
        )
        self._port = server.add_insecure_port(f"{self._host}:{self._port}")
        await server.start()
        self._server = server

    async def stop(self) -> None:
        """Stop serving."""
        if self._server is not None:
            await self._server.stop(0)
            self._server = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    @property
    def endpoint(self) -> str:
        """`http://HOST:PORT`, as OTEL_EXPORTER_OTLP_ENDPOINT takes it."""
        return f"http://{self._host}:{self._port}"

    def env(self, *, export_ms: int = 200) -> dict[str, str]:
        """The environment that makes a service export here, every `export_ms` milliseconds."""
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": str(export_ms),
            "OTEL_METRIC_EXPORT_INTERVAL": str(export_ms),
        }

    # -- reading -----------------------------------------------------------------------------

    @property
    def spans(self) -> list[ExportedSpan]:
        """Every span received, in arrival order."""
        return list(self.received.spans)

    def trace(self, trace_id: str) -> list[ExportedSpan]:
        """The spans of one trace."""
        return [s for s in self.received.spans if s.trace_id == trace_id]

    def spans_about(self, run_id: str) -> list[ExportedSpan]:
        """The spans whose `tether.run.id` is `run_id`."""
        return [s for s in self.received.spans if s.attributes.get("tether.run.id") == run_id]

    def total(self, name: str, **attributes: Any) -> float:
        """A counter's value now, summed over every process that reports it (each reports its
        cumulative total: its latest point counts) and every series whose attributes include
        `attributes` (dots in a key are written as `__`: tether__tenant)."""
        wanted = {k.replace("__", "."): v for k, v in attributes.items()}
        latest: dict[tuple[str, tuple[tuple[str, Any], ...]], MetricPoint] = {}
        for point in self.received.points:
            if point.name != name or any(point.attributes.get(k) != v for k, v in wanted.items()):
                continue
            key = (point.instance, tuple(sorted(point.attributes.items())))
            if key not in latest or point.time_ns >= latest[key].time_ns:
                latest[key] = point
        return sum(p.count or p.value for p in latest.values())

    def latest(self, name: str) -> MetricPoint | None:
        """A gauge's most recent point, from whichever process sent it."""
        found = [p for p in self.received.points if p.name == name]
        return max(found, key=lambda p: p.time_ns) if found else None


async def _serve(port: int) -> None:
    collector = Collector(port=port, keep=False)
    await collector.start()
    print(f"collector listening {collector.endpoint}", flush=True)  # noqa: T201
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    received = collector.received
    print(  # noqa: T201
        f"collector received {received.span_batches} span batches, "
        f"{received.metric_batches} metric batches, {received.span_count} spans",
        file=sys.stderr,
        flush=True,
    )
    await collector.stop()


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m tether.testing.collector --port PORT`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=4317)
    args = parser.parse_args(argv)
    asyncio.run(_serve(args.port))


if __name__ == "__main__":
    main()
