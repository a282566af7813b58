"""Tether's spans, recorded lean on the request path and encoded for OTLP off it.

The OpenTelemetry SDK's span costs its caller about 25 us to start and end (locked, bounded
attribute and event containers, a processor chain) and its exporting thread about 38 us to
encode (`encode_spans` builds a protobuf object per attribute, value and span): a run's six
spans cost more than the rest of telemetry together. Here a span is a plain object holding
what it was given (`RecordedSpan`); ending it hands it to the SDK's `BatchSpanProcessor` (its
queue, its OTEL_BSP_* settings, its exporting thread, its flush at exit), whose exporter is
the SDK's OTLP/gRPC one (its endpoint, headers, TLS, compression, retries) with the encoding
replaced (`RecordedSpanExporter`): protobuf's wire bytes written directly, each distinct short
attribute pair encoded once and reused. About 10 us a span, started to encoded.

Sampling is the SDK's own: the sampler `OTEL_TRACES_SAMPLER` and `OTEL_TRACES_SAMPLER_ARG` name
(as the SDK's TracerProvider reads them) decides each span from its parent's context, so under
`parentbased_*` a run's trace is kept or dropped whole. A span not sampled is a
`NonRecordingSpan`: it still carries the trace context on, and costs nothing to export.
"""

from __future__ import annotations

import atexit
import random
import struct
import time
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import Decision, Sampler
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)
from opentelemetry.util.types import Attributes

_PARENT_BASED_ALWAYS_ON = (
    "ParentBased{root:AlwaysOnSampler,remoteParentSampled:AlwaysOnSampler,"
    "remoteParentNotSampled:AlwaysOffSampler,localParentSampled:AlwaysOnSampler,"
    "localParentNotSampled:AlwaysOffSampler}"
)
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
# OTLP's span flags: whether the parent was remote is known (bit 8), and it was (bit 9).
_PARENT_KNOWN, _PARENT_REMOTE = 0x100, 0x200


class RecordedSpan(trace.Span):
    """A sampled span: what it was started with, what was set on it, and its end."""

    __slots__ = (
        "_processor",
        "attributes",
        "context",
        "end_time",
        "events",
        "kind",
        "links",
        "name",
        "parent",
        "scope",
        "start_time",
        "status",
    )

    def __init__(
        self,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: SpanKind,
        start_time: int,
        attributes: dict[str, Any],
        links: Sequence[Link] | None,
        scope: bytes,
        processor: BatchSpanProcessor,
    ) -> None:
        self.name = name
        self.context = context
        self.parent = parent
        self.kind = kind
        self.start_time = start_time
        self.end_time: int | None = None
        self.attributes = attributes
        self.events: list[tuple[str, int, dict[str, Any]]] | None = None
        self.links = links
        self.status: Status | None = None
        self.scope = scope
        self._processor = processor

    def end(self, end_time: int | None = None) -> None:
        if self.end_time is not None:
            return
        self.end_time = end_time or time.time_ns()
        self._processor.on_end(self)  # type: ignore[arg-type]  # what the exporter below reads

    def get_span_context(self) -> SpanContext:
        return self.context

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        if self.end_time is None:
            self.attributes.update(attributes)

    def set_attribute(self, key: str, value: Any) -> None:
        if self.end_time is None:
            self.attributes[key] = value

    def add_event(
        self, name: str, attributes: Attributes = None, timestamp: int | None = None
    ) -> None:
        if self.end_time is None:
            event = (name, timestamp or time.time_ns(), dict(attributes or {}))
            self.events = [*(self.events or ()), event]

    def add_link(self, context: SpanContext, attributes: Attributes = None) -> None:
        if self.end_time is None and context.is_valid:
            self.links = [*(self.links or ()), Link(context, attributes)]

    def update_name(self, name: str) -> None:
        if self.end_time is None:
            self.name = name

    def is_recording(self) -> bool:
        return self.end_time is None

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        if self.end_time is not None or (self.status and self.status.status_code is StatusCode.OK):
            return  # OK is final (the API's rule)
        self.status = status if isinstance(status, Status) else Status(status, description)

    def record_exception(
        self,
        exception: BaseException,
        attributes: Attributes = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        self.add_event(
            "exception",
            {
                "exception.type": type(exception).__qualname__,
                "exception.message": str(exception),
                "exception.escaped": escaped,
                **(attributes or {}),
            },
            timestamp,
        )


class RecordingTracer(trace.Tracer):
    """Starts `RecordedSpan`s for one instrumentation scope."""

    def __init__(self, scope: bytes, sampler: Sampler, processor: Any) -> None:
        self._scope = scope
        self._sampler = sampler
        # The SDK's default (and the bench's): decided here from the parent's flag alone, as
        # that sampler decides, without its result objects.
        self._parent_or_on = sampler.get_description() == _PARENT_BASED_ALWAYS_ON
        self._processor = processor

    def start_span(
        self,
        name: str,
        context: otel_context.Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> trace.Span:
        parent = trace.get_current_span(context).get_span_context()
        parent_valid = parent.is_valid
        trace_id = parent.trace_id if parent_valid else random.getrandbits(128) or 1
        span_id = random.getrandbits(64) or 1
        kept = dict(attributes) if attributes else {}
        if self._parent_or_on:
            sampled = recording = not parent_valid or parent.trace_flags.sampled
            trace_state = parent.trace_state if parent_valid else None
        else:
            result = self._sampler.should_sample(context, trace_id, name, kind, attributes, links)
            sampled = result.decision is Decision.RECORD_AND_SAMPLE
            recording = result.decision is not Decision.DROP
            trace_state = result.trace_state
            kept.update(result.attributes or {})
        span_context = SpanContext(
            trace_id,
            span_id,
            is_remote=False,
            trace_flags=_SAMPLED if sampled else _NOT_SAMPLED,
            trace_state=trace_state,
        )
        if not recording:
            return NonRecordingSpan(span_context)
        return RecordedSpan(
            name,
            span_context,
            parent if parent_valid else None,
            kind,
            start_time or time.time_ns(),
            kept,
            [link for link in links if link.context.is_valid] if links else None,
            self._scope,
            self._processor,
        )

    def start_as_current_span(  # type: ignore[override]  # a context manager, as the API's
        self,
        name: str,
        context: otel_context.Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
        end_on_exit: bool = True,
    ) -> _Current:
        started = self.start_span(name, context, kind, attributes, links, start_time)
        return _Current(started, end_on_exit, record_exception, set_status_on_exception)


class _Current:
    """A span current inside a `with` block (the API's `use_span`, as a class)."""

    __slots__ = ("_end", "_record", "_span", "_status", "_token")

    def __init__(self, span: trace.Span, end: bool, record: bool, status: bool) -> None:
        self._span, self._end, self._record, self._status = span, end, record, status
        self._token: object = None

    def __enter__(self) -> trace.Span:
        self._token = otel_context.attach(trace.set_span_in_context(self._span))
        return self._span

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _: Any) -> None:
        otel_context.detach(self._token)  # type: ignore[arg-type]  # what attach returned
        span = self._span
        if isinstance(exc, Exception) and span.is_recording():
            if self._record:
                span.record_exception(exc, escaped=True)
            if self._status:
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        if self._end:
            span.end()


class RecordingTracerProvider(trace.TracerProvider):
    """The tracer provider of a service exporting its spans: `RecordingTracer`s sharing one
    batch processor, flushed when the process exits normally."""

    def __init__(
        self,
        resource: Resource,
        exporter: SpanExporter | None = None,
        *,
        max_queue_size: int | None = None,
    ) -> None:
        # The SDK's provider reads the sampler from OTEL_TRACES_SAMPLER(_ARG) as it documents;
        # it is kept for that and for nothing else (it records no span).
        self.sampler: Sampler = SdkTracerProvider(resource=resource, shutdown_on_exit=False).sampler
        # The queue's bound: OTEL_BSP_MAX_QUEUE_SIZE (2048) unless given.
        self.processor = BatchSpanProcessor(
            exporter or RecordedSpanExporter(resource), max_queue_size=max_queue_size
        )
        self._tracers: dict[str, RecordingTracer] = {}
        atexit.register(self.shutdown)

    def get_tracer(
        self,
        instrumenting_module_name: str,
        instrumenting_library_version: str | None = None,
        schema_url: str | None = None,
        attributes: Attributes = None,
    ) -> RecordingTracer:
        key = f"{instrumenting_module_name}\0{instrumenting_library_version or ''}"
        tracer = self._tracers.get(key)
        if tracer is None:
            scope = scope_bytes(instrumenting_module_name, instrumenting_library_version or "")
            tracer = self._tracers[key] = RecordingTracer(scope, self.sampler, self.processor)
        return tracer

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self.processor.force_flush(timeout_millis)

    def shutdown(self) -> None:
        self.processor.shutdown()  # type: ignore[no-untyped-call]  # the SDK's, unannotated


# -- encoding ------------------------------------------------------------------------------------
#
# OTLP's protobuf, written as bytes: a span is a handful of fields, and building it as protobuf
# objects (one per attribute, value and span, each copied into its parent) is most of what the
# SDK's exporter costs. Each message is its fields in the protobuf wire format: a tag (field
# number << 3 | wire type) then a varint, eight little-endian bytes, or a length and bytes.
# The whole request is parsed back once (in C) for the exporter, which sends it as it would its
# own. `tests/unit/test_telemetry_recorder.py` holds it to the SDK's encoding of the same spans.

_LEN, _FIXED64 = 2, 1  # wire types: length-delimited, eight bytes
_PAIR_CACHE_LIMIT = 4096  # distinct (key, value) pairs kept encoded; emptied when full
_CACHED_TEXT = 64  # longer texts (ids, messages) are encoded each time


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int64 as protobuf writes it: ten bytes
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (bytes, a string, an embedded message)."""
    return _varint(number << 3 | _LEN) + _varint(len(payload)) + payload


def _fixed64(number: int, value: int) -> bytes:
    return _varint(number << 3 | _FIXED64) + value.to_bytes(8, "little")


def any_value(value: Any) -> bytes | None:
    """An attribute value as OTLP's AnyValue; None for what an attribute cannot be."""
    if isinstance(value, str):
        return _field(1, value.encode())
    if isinstance(value, bool):
        return b"\x10" + (b"\x01" if value else b"\x00")
    if isinstance(value, int):
        return b"\x18" + _varint(value)
    if isinstance(value, float):
        return b"\x21" + struct.pack("<d", value)
    if isinstance(value, bytes):
        return _field(7, value)
    if isinstance(value, Sequence):
        values = [any_value(v) for v in value]
        return _field(5, b"".join(_field(1, v) for v in values if v is not None))
    return None


class _Pairs:
    """Attribute pairs (OTLP's KeyValue) as bytes: a pair of a small kind (a short text, a
    bool, an int) is encoded once per distinct (key, value) and reused."""

    def __init__(self) -> None:
        self._made: dict[tuple[str, type, Any], bytes] = {}

    def encode(self, number: int, attributes: Mapping[str, Any]) -> bytes:
        """Each pair as field `number` of the message that holds them."""
        made = self._made
        out = []
        for key, value in attributes.items():
            kind = type(value)
            cacheable = kind is bool or kind is int or (kind is str and len(value) <= _CACHED_TEXT)
            if cacheable:
                pair = made.get((key, kind, value))
                if pair is not None:
                    out.append(pair)
                    continue
            encoded = any_value(value)
            if encoded is None:
                continue  # not an attribute value: left out, as the SDK drops it
            pair = _field(number, _field(1, key.encode()) + _field(2, encoded))
            if cacheable:
                if len(made) >= _PAIR_CACHE_LIMIT:
                    made.clear()
                made[(key, kind, value)] = pair
            out.append(pair)
        return b"".join(out)


def scope_bytes(name: str, version: str = "") -> bytes:
    """An InstrumentationScope."""
    return _field(1, name.encode()) + (_field(2, version.encode()) if version else b"")


def _context_flags(context: SpanContext, remote: bool) -> bytes:
    """A span's or a link's flags (fixed32): its trace flags, and whether its parent (the
    linked span) is remote, which is known."""
    flags = _PARENT_KNOWN | (_PARENT_REMOTE if remote else 0) | int(context.trace_flags)
    return b"\x85\x01" + flags.to_bytes(4, "little")  # field 16 of a span, 6 of a link


def _span_bytes(span: RecordedSpan, pairs: _Pairs) -> bytes:
    context, parent = span.context, span.parent
    out = [
        b"\x0a\x10" + context.trace_id.to_bytes(16, "big"),
        b"\x12\x08" + context.span_id.to_bytes(8, "big"),
    ]
    if context.trace_state:
        out.append(_field(3, context.trace_state.to_header().encode()))
    if parent is not None:
        out.append(b"\x22\x08" + parent.span_id.to_bytes(8, "big"))
    out.append(_field(5, span.name.encode()))
    out.append(b"\x30" + _varint(span.kind.value + 1))  # OTLP's kinds count from UNSPECIFIED
    out.append(_fixed64(7, span.start_time))
    out.append(_fixed64(8, span.end_time or span.start_time))
    out.append(pairs.encode(9, span.attributes))
    for name, at, attributes in span.events or ():
        out.append(
            _field(11, _fixed64(1, at) + _field(2, name.encode()) + pairs.encode(3, attributes))
        )
    for link in span.links or ():
        linked = link.context
        body = [
            b"\x0a\x10" + linked.trace_id.to_bytes(16, "big"),
            b"\x12\x08" + linked.span_id.to_bytes(8, "big"),
        ]
        if linked.trace_state:
            body.append(_field(3, linked.trace_state.to_header().encode()))
        body.append(pairs.encode(4, link.attributes or {}))
        body.append(b"\x35" + _context_flags(linked, linked.is_remote)[2:])  # field 6, fixed32
        out.append(_field(13, b"".join(body)))
    status = span.status
    if status is None or status.status_code is StatusCode.UNSET:
        out.append(b"\x7a\x00")  # an empty status, as the SDK's exporter writes one
    else:
        message = status.description or ""
        code = b"\x18" + _varint(status.status_code.value)
        out.append(_field(15, (_field(2, message.encode()) if message else b"") + code))
    out.append(_context_flags(context, parent is not None and parent.is_remote))
    return b"".join(out)


class RecordedSpanExporter(OTLPSpanExporter):
    """The SDK's OTLP/gRPC span exporter, encoding `RecordedSpan`s (everything else about
    exporting is the SDK's: endpoint, headers, TLS, compression, timeout, retries)."""

    def __init__(self, resource: Resource, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._pairs = _Pairs()
        self._resource = _field(1, _Pairs().encode(1, resource.attributes))

    def _translate_data(self, data: Sequence[Any]) -> ExportTraceServiceRequest:
        return ExportTraceServiceRequest.FromString(encode(data, self._resource, self._pairs))


def encode(spans: Sequence[RecordedSpan], resource: bytes, pairs: _Pairs) -> bytes:
    """`spans` as one OTLP ExportTraceServiceRequest of `resource` (an encoded Resource field
    of ResourceSpans), grouped by instrumentation scope."""
    by_scope: dict[bytes, list[bytes]] = {}
    for span in spans:
        encoded = _field(2, _span_bytes(span, pairs))
        group = by_scope.get(span.scope)
        if group is None:
            by_scope[span.scope] = [encoded]
        else:
            group.append(encoded)
    scopes = b"".join(
        _field(2, _field(1, scope) + b"".join(encoded)) for scope, encoded in by_scope.items()
    )
    return _field(1, resource + scopes)
