"""`configure`: the one telemetry setup of every service, called once by its main."""

from __future__ import annotations

import os
import socket

import tether.telemetry
from tether.settings import PlatformSettings
from tether.telemetry.logs import configure_logging


def configure(service: str, settings: PlatformSettings, *, instance: str = "") -> None:
    """Log as `settings` say; when `settings.otlp_endpoint` names a collector, export traces
    and metrics there over OTLP (the exporters read the other standard OTEL_* variables) and
    turn `tether.telemetry.on` on. Off, not even the SDK is loaded.

    `instance` names this process among the service's replicas (default host-pid). Spans and
    metrics still queued are flushed when the process exits normally."""
    configure_logging(service, settings.log_level, settings.log_format)
    if not settings.otlp_endpoint:
        return
    # Loaded only when exporting: the SDK and the exporters cost a tenth of a second to import.
    from opentelemetry import metrics as metrics_api
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource

    from tether.telemetry import metrics, tracing
    from tether.telemetry.recorder import RecordingTracerProvider

    resource = Resource.create(
        {
            "service.name": f"tether-{service}",
            "service.namespace": "tether",
            "service.instance.id": instance or f"{socket.gethostname()}-{os.getpid()}",
        }
    )
    # Spans recorded lean and encoded off the request path (`recorder`), sampled as
    # OTEL_TRACES_SAMPLER says.
    tracer_provider = RecordingTracerProvider(resource)
    trace.set_tracer_provider(tracer_provider)
    reader = PeriodicExportingMetricReader(OTLPMetricExporter())
    meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
    metrics_api.set_meter_provider(meter_provider)
    tracing.tracer = tracer_provider.get_tracer("tether")
    tracing.content = settings.telemetry_content
    metrics.start(meter_provider.get_meter("tether"), tenants=settings.telemetry_tenants.split(","))
    tether.telemetry.on = True


def metric_export_interval_s() -> float:
    """How often metrics are exported (OTEL_METRIC_EXPORT_INTERVAL, in ms; 60 s by default):
    what a gauge read in the background need not be read more often than."""
    try:
        return max(int(os.environ.get("OTEL_METRIC_EXPORT_INTERVAL", "60000")), 100) / 1000
    except ValueError:
        return 60.0
