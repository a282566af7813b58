"""The metrics every service records, with labels kept bounded.

A tenant is a label of its own only when it is on the allow-list (TETHER_TELEMETRY_TENANTS);
every other tenant is `other`. Models and error codes are labels only while they look like the
identifiers they are (short, lower-case), else `other`, so no input grows a series per value.

| instrument | kind | labels | recorded by |
|---|---|---|---|
| `tether.runs` | counter | status, tenant | the orchestrator: a run ended, parked, retries |
| `tether.admissions` | counter | disposition, tenant | admission |
| `tether.queue.depth` | gauge | | the orchestrator (queued runs) |
| `tether.queue.oldest_age` | gauge, s | | the orchestrator (the longest-queued run) |
| `tether.claim.latency` | histogram, s | tenant | the orchestrator: queued until leased |
| `tether.lease.expirations` | counter | | the reaper, per lapsed lease |
| `tether.reaps` | counter | outcome | the reaper: requeued, failed or cancelled |
| `tether.retries` | counter | error.type, tenant | the orchestrator, per retry scheduled |
| `tether.stage.duration` | histogram, s | stage | the orchestrator: at claims, completions |
| `tether.tokens` | counter | tenant, model, gen_ai.token.type | the worker, per model turn |
| `tether.cost` | counter, micro-USD | tenant, model | the worker, per model turn |
| `tether.stream.subscribers` | gauge | | the gateway (open streams) |
| `tether.stream.slow_consumer_cuts` | counter | | the gateway |

Everything here is called only while `tether.telemetry.on` is True.

A counter costs its hot path a dictionary addition, not the SDK's measurement (about 6 us with
its attributes checked and its view matched, where the addition takes 0.1 us): each is tallied
here, by its label values, and reported cumulatively when the metrics are collected (an
observable counter, read off the request path by the exporting thread), its attributes built
then, once per series and export, not per event.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from opentelemetry.metrics import CallbackOptions, Meter, Observation

OTHER = "other"
# What a model id or an error code looks like; anything else is counted as `other`.
_IDENTIFIER = re.compile(r"[a-z0-9][a-z0-9_.:@-]{0,63}")
# Stage durations arrive in milliseconds (as the attempts row stores them).
_STAGES = ("routing", "context", "attempt", "finalisation", "total")
# Histogram buckets in seconds: a claim or a stage takes milliseconds to minutes.
_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class _Tally:
    """A counter kept as cumulative sums by label values (`keys` names them, in order),
    reported as an observable counter when the metrics are collected."""

    def __init__(self, meter: Meter, name: str, keys: tuple[str, ...], **described: str) -> None:
        self._keys = keys
        self._sums: dict[tuple[str, ...], float] = {}
        meter.create_observable_counter(name, [self._observe], **described)

    def add(self, amount: float, *values: str) -> None:
        """Count `amount` for the series `values` (one per key, in order)."""
        self._sums[values] = self._sums.get(values, 0) + amount

    def _observe(self, _: CallbackOptions) -> Iterable[Observation]:
        # A copy is taken whole under the GIL: the event loop's thread goes on adding.
        sums = self._sums.copy()
        return [Observation(v, dict(zip(self._keys, k, strict=True))) for k, v in sums.items()]


@dataclass
class _QueueReading:
    """The queue as last read: depth, and how long its oldest run had waited then."""

    depth: int = 0
    oldest_age_s: float = 0.0
    read_at: float = 0.0  # time.monotonic() of the reading; 0 before the first


class _Instruments:
    def __init__(self, meter: Meter) -> None:
        self.runs = _Tally(
            meter,
            "tether.runs",
            ("tether.run.status", "tether.tenant"),
            description="Runs that reached a status, by status and tenant.",
        )
        self.admissions = _Tally(
            meter,
            "tether.admissions",
            ("tether.disposition", "tether.tenant"),
            description="Admissions, by disposition and tenant.",
        )
        self.claim_latency = meter.create_histogram(
            "tether.claim.latency",
            unit="s",
            description="How long a run waited queued (and its conversation's head) before a "
            "worker leased it.",
            explicit_bucket_boundaries_advisory=_SECONDS,
        )
        self.lease_expirations = _Tally(
            meter,
            "tether.lease.expirations",
            (),
            description="Leases that lapsed (their worker went quiet).",
        )
        self.reaps = _Tally(
            meter,
            "tether.reaps",
            ("tether.reap.outcome",),
            description="Runs the reaper moved, by what it did with them.",
        )
        self.retries = _Tally(
            meter,
            "tether.retries",
            ("error.type", "tether.tenant"),
            description="Retries scheduled, by error class and tenant.",
        )
        self.stage_duration = meter.create_histogram(
            "tether.stage.duration",
            unit="s",
            description="Where an attempt spent its time, by stage.",
            explicit_bucket_boundaries_advisory=_SECONDS,
        )
        self.tokens = _Tally(
            meter,
            "tether.tokens",
            ("tether.tenant", "gen_ai.request.model", "gen_ai.token.type"),
            unit="{token}",
            description="Model tokens, by tenant, model and type.",
        )
        self.cost = _Tally(
            meter,
            "tether.cost",
            ("tether.tenant", "gen_ai.request.model"),
            unit="uUSD",
            description="Model cost in micro-USD, by tenant and model.",
        )
        self.cuts = _Tally(
            meter,
            "tether.stream.slow_consumer_cuts",
            (),
            description="Streams ended because their client fell behind.",
        )
        self.meter = meter
        self.queue = _QueueReading()


_instruments: _Instruments | None = None
_tenants: frozenset[str] = frozenset()


def start(meter: Meter, *, tenants: Iterable[str] = ()) -> None:
    """Create the instruments on `meter`; `tenants` get a label of their own."""
    global _instruments, _tenants
    _instruments = _Instruments(meter)
    _tenants = frozenset(t.strip() for t in tenants if t.strip())


def _m() -> _Instruments:
    if _instruments is None:
        raise RuntimeError("metrics recorded before telemetry.setup.configure started them")
    return _instruments


def tenant_label(tenant_id: str) -> str:
    """The tenant's label: its id when allow-listed, else `other`."""
    return tenant_id if tenant_id in _tenants else OTHER


def identifier_label(value: str) -> str:
    """A model id or error code as a label, or `other` when it does not look like one."""
    return value if _IDENTIFIER.fullmatch(value) else OTHER


# -- the orchestrator --------------------------------------------------------------------------


def run_moved(status: str, tenant_id: str) -> None:
    """A run reached `status`."""
    _m().runs.add(1, status, tenant_label(tenant_id))


def claimed(queue_wait_s: float, routing_ms: float, tenant_id: str) -> None:
    """A run was leased after waiting `queue_wait_s`; its routing took `routing_ms`."""
    m = _m()
    m.claim_latency.record(max(queue_wait_s, 0.0), {"tether.tenant": tenant_label(tenant_id)})
    m.stage_duration.record(routing_ms / 1000, {"tether.stage": "routing"})


def stages(durations_ms: Mapping[str, float]) -> None:
    """An attempt's stage durations (`context_ms`, ...), as the worker reported them."""
    m = _m()
    for stage in _STAGES[1:]:
        value = durations_ms.get(f"{stage}_ms")
        if value:
            m.stage_duration.record(value / 1000, {"tether.stage": stage})


def retry(error_code: str, tenant_id: str) -> None:
    """A retry was scheduled after an error of class `error_code`."""
    _m().retries.add(1, identifier_label(error_code), tenant_label(tenant_id))


def reaped(outcome: str) -> None:
    """The reaper found a lease lapsed and moved its run (`outcome`: requeued, failed,
    cancelled)."""
    m = _m()
    m.lease_expirations.add(1)
    m.reaps.add(1, outcome)


def observe_queue() -> Callable[[int, float], None]:
    """Export the queue's depth and oldest age as gauges; returns what a reading is reported
    to (the orchestrator reads the queue in the background: a gauge callback cannot wait for
    the database)."""
    m = _m()
    reading = m.queue

    def depth(_: CallbackOptions) -> Iterable[Observation]:
        return [Observation(reading.depth)] if reading.read_at else []

    def oldest(_: CallbackOptions) -> Iterable[Observation]:
        if not reading.read_at:
            return []
        # Aged since it was read, while anything was queued then.
        since = time.monotonic() - reading.read_at if reading.depth else 0.0
        return [Observation(reading.oldest_age_s + since)]

    m.meter.create_observable_gauge(
        "tether.queue.depth", [depth], description="Runs queued, waiting for a worker."
    )
    m.meter.create_observable_gauge(
        "tether.queue.oldest_age",
        [oldest],
        unit="s",
        description="How long the longest-queued run has waited.",
    )

    def report(depth: int, oldest_age_s: float) -> None:
        reading.depth, reading.oldest_age_s = depth, oldest_age_s
        reading.read_at = time.monotonic()

    return report


# -- admission, the worker, the gateway ----------------------------------------------------------


def admitted(disposition: str, tenant_id: str) -> None:
    """An event was admitted with `disposition` (created, attached, replayed, retried)."""
    _m().admissions.add(1, disposition, tenant_label(tenant_id))


def model_turn(tenant_id: str, model: str, usage: Mapping[str, int], cost_micros: int) -> None:
    """One model turn's tokens (`input_tokens`, ...) and cost."""
    m = _m()
    tenant, model_label = tenant_label(tenant_id), identifier_label(model)
    for field, count in usage.items():
        if count:
            kind = field.removesuffix("_tokens").removesuffix("_input")
            m.tokens.add(count, tenant, model_label, kind)
    if cost_micros:
        m.cost.add(cost_micros, tenant, model_label)


def observe_subscribers(count: Callable[[], int]) -> None:
    """Export `count()` (the streams open now) as a gauge."""

    def subscribers(_: CallbackOptions) -> Iterable[Observation]:
        return [Observation(count())]

    _m().meter.create_observable_gauge(
        "tether.stream.subscribers",
        [subscribers],
        description="Streams following runs live on this gateway.",
    )


def slow_consumer_cut() -> None:
    """A stream was ended because its client fell behind."""
    _m().cuts.add(1)
