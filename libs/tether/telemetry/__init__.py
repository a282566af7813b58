"""Telemetry for every service: JSON logs always; traces and metrics over OTLP when a collector
is named (`OTEL_EXPORTER_OTLP_ENDPOINT`), and nothing at all otherwise.

| module | job |
|---|---|
| `setup` | `configure(service, settings)`: the one setup each service's main calls |
| `logs` | JSON lines carrying the tenant, run, attempt and trace ids of what they are about |
| `tracing` | spans, and the W3C trace context on gRPC metadata, on Work messages and on the run |
| `recorder` | spans recorded lean, sampled by `OTEL_TRACES_SAMPLER`, encoded off the request path |
| `metrics` | the instruments, their bounded labels, and what records them |

`on` is the one switch the hot path reads. It is False unless `configure` set up export, and
while it is False no span, attribute or measurement is built: every instrumented place is
guarded by it (`if telemetry.on:`), and the gRPC wrappers choose their traced form once, when
a server or channel is made.

Privacy: spans and logs carry ids, counts, timings and error codes. Message text, model output
and tool inputs are recorded on spans only when `TETHER_TELEMETRY_CONTENT` opts in
(`tracing.content`), and never in logs.
"""

on = False
