"""The services' spans (`tether.telemetry.recorder`): encoded for OTLP exactly as the SDK's
exporter encodes the same spans, sampled as OTEL_TRACES_SAMPLER says, and ended once."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)

from tether.errors import InvalidArgument
from tether.telemetry import recorder, tracing

RESOURCE = Resource.create({"service.name": "tether-test", "service.instance.id": "host-1"})


class Kept(SpanExporter):
    """Keeps what it is given."""

    def __init__(self) -> None:
        self.spans: list[Any] = []

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS


@pytest.fixture
def provider() -> Iterator[tuple[recorder.RecordingTracerProvider, Kept]]:
    kept = Kept()
    made = recorder.RecordingTracerProvider(RESOURCE, kept)
    yield made, kept
    made.shutdown()


def ended(made: recorder.RecordingTracerProvider, kept: Kept) -> list[recorder.RecordedSpan]:
    made.force_flush()
    return kept.spans


REMOTE = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
ATTRIBUTES: dict[str, Any] = {
    "text": "short",
    "long": "x" * 200,
    "count": 7,
    "negative": -3,
    "big": 2**62,
    "ratio": 0.25,
    "yes": True,
    "no": False,
    "words": ["a", "b"],
    "numbers": [1, -2],
}


def shapes(made: recorder.RecordingTracerProvider) -> None:
    """Spans of every shape the encoding has a branch for."""
    tracer = made.get_tracer("tether")
    other = made.get_tracer("other", "1.2")
    root = tracer.start_span("root", kind=SpanKind.SERVER, attributes=ATTRIBUTES, start_time=5)
    child = tracer.start_span(
        "child", context=trace.set_span_in_context(root), kind=SpanKind.CLIENT
    )
    child.add_event("happened", {"at": 1, "what": "it"}, timestamp=9)
    child.set_status(Status(StatusCode.ERROR, "RuntimeError"))
    child.end(end_time=11)
    remote_child = other.start_span(
        "remote child",
        context=trace.set_span_in_context(
            NonRecordingSpan(
                SpanContext(
                    0xABC,
                    0xDEF,
                    is_remote=True,
                    trace_flags=TraceFlags(TraceFlags.SAMPLED),
                    trace_state=TraceState([("vendor", "value")]),
                )
            )
        ),
        links=[Link(REMOTE, {"why": "resumed"}), Link(trace.INVALID_SPAN_CONTEXT)],
    )
    remote_child.set_status(StatusCode.OK)
    remote_child.end()
    root.end(end_time=12)


def as_sdk(span: recorder.RecordedSpan) -> ReadableSpan:
    """The SDK's own span with what `span` holds."""
    name, version = "tether", None
    if span.scope != recorder.scope_bytes("tether"):
        name, version = "other", "1.2"
    return ReadableSpan(
        name=span.name,
        context=span.context,
        parent=span.parent,
        resource=RESOURCE,
        attributes=span.attributes,
        events=[Event(n, a, timestamp=t) for n, t, a in span.events or ()],
        links=span.links or (),
        kind=span.kind,
        status=span.status or Status(StatusCode.UNSET),
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=InstrumentationScope(name, version),
    )


def test_a_span_is_encoded_as_the_sdks_exporter_encodes_it(
    provider: tuple[recorder.RecordingTracerProvider, Kept],
) -> None:
    made, kept = provider
    shapes(made)
    spans = ended(made, kept)
    assert [s.name for s in spans] == ["child", "remote child", "root"]
    ours = recorder.RecordedSpanExporter(RESOURCE)._translate_data(spans)
    sdks = encode_spans([as_sdk(s) for s in spans])
    # The bytes parse as the request, and say what the SDK's encoding says, field by field.
    assert ExportTraceServiceRequest.FromString(ours.SerializeToString()) == ours
    [our_resource], [sdk_resource] = ours.resource_spans, sdks.resource_spans
    assert our_resource.resource == sdk_resource.resource
    by_scope = {s.scope.name: s for s in sdk_resource.scope_spans}
    assert len(our_resource.scope_spans) == len(by_scope) == 2
    for scope_spans in our_resource.scope_spans:
        theirs = by_scope[scope_spans.scope.name]
        assert scope_spans.scope == theirs.scope
        assert len(scope_spans.spans) == len(theirs.spans)
        for our, sdk in zip(scope_spans.spans, theirs.spans, strict=True):
            # Ours also carries the trace flags in the low byte, as OTLP defines them.
            assert our.flags & 0xFF == TraceFlags.SAMPLED
            for link, sdk_link in zip(our.links, sdk.links, strict=True):
                assert link.flags & 0xFF == TraceFlags.SAMPLED
                link.flags &= ~0xFF
                assert link == sdk_link
            our.flags &= ~0xFF
            del our.links[:]
            del sdk.links[:]
            assert our == sdk


def test_the_default_sampler_keeps_a_whole_trace_and_a_parents_no(
    provider: tuple[recorder.RecordingTracerProvider, Kept],
) -> None:
    made, kept = provider
    tracer = made.get_tracer("tether")
    unsampled = NonRecordingSpan(SpanContext(0xABC, 0xDEF, is_remote=True))
    with (
        tracer.start_as_current_span("root") as root,
        tracer.start_as_current_span("child") as child,
    ):
        assert child.get_span_context().trace_id == root.get_span_context().trace_id
    dropped = tracer.start_span("dropped", context=trace.set_span_in_context(unsampled))
    assert not dropped.is_recording()
    assert not dropped.get_span_context().trace_flags.sampled
    assert dropped.get_span_context().trace_id == 0xABC
    dropped.end()
    assert [s.name for s in ended(made, kept)] == ["child", "root"]


@pytest.mark.parametrize(
    ("sampler", "argument"), [("parentbased_traceidratio", "0.5"), ("traceidratio", "0.5")]
)
def test_a_ratio_sampler_keeps_or_drops_a_trace_whole(
    monkeypatch: pytest.MonkeyPatch, sampler: str, argument: str
) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", sampler)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", argument)
    kept = Kept()
    made = recorder.RecordingTracerProvider(RESOURCE, kept)
    tracer = made.get_tracer("tether")
    roots = 200
    for _ in range(roots):
        with tracer.start_as_current_span("root"), tracer.start_as_current_span("child"):
            pass
    spans = ended(made, kept)
    made.shutdown()
    by_trace: dict[int, list[str]] = {}
    for span in spans:
        by_trace.setdefault(span.context.trace_id, []).append(span.name)
    assert 0 < len(by_trace) < roots  # some kept, some dropped
    assert all(names == ["child", "root"] for names in by_trace.values())


def test_always_off_records_nothing_and_still_carries_the_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    kept = Kept()
    made = recorder.RecordingTracerProvider(RESOURCE, kept)
    tracer = made.get_tracer("tether")
    with tracer.start_as_current_span("root") as root:
        assert not root.is_recording()
        assert root.get_span_context().is_valid
        assert tracing.traceparent().endswith("-00")
    assert ended(made, kept) == []
    made.shutdown()


def test_a_span_ends_once_and_changes_nothing_after(
    provider: tuple[recorder.RecordingTracerProvider, Kept],
) -> None:
    made, kept = provider
    span = made.get_tracer("tether").start_span("once", attributes={"a": 1})
    span.set_status(StatusCode.OK)
    span.set_status(StatusCode.ERROR)  # OK is final
    span.end(end_time=20)
    span.end(end_time=30)
    span.set_attribute("b", 2)
    span.update_name("renamed")
    [only] = ended(made, kept)
    assert (only.name, only.attributes, only.end_time) == ("once", {"a": 1}, 20)
    assert only.status is not None and only.status.status_code is StatusCode.OK


def test_an_exception_leaving_a_current_span_is_recorded_unless_asked_not_to(
    provider: tuple[recorder.RecordingTracerProvider, Kept],
) -> None:
    made, kept = provider
    tracer = made.get_tracer("tether")
    with pytest.raises(ValueError), tracer.start_as_current_span("recorded"):
        raise ValueError("bad")
    with (
        pytest.raises(ValueError),
        tracer.start_as_current_span(
            "quiet", record_exception=False, set_status_on_exception=False
        ),
    ):
        raise ValueError("bad")
    recorded, quiet = ended(made, kept)
    assert recorded.status is not None and recorded.status.status_code is StatusCode.ERROR
    assert [(name, a["exception.type"]) for name, _, a in recorded.events or ()] == [
        ("exception", "ValueError")
    ]
    assert (quiet.status, quiet.events) == (None, None)
    assert trace.get_current_span() is trace.INVALID_SPAN  # each block restored the context


class Parked(Exception):
    pass


def test_a_blocks_span_names_how_it_ended(
    provider: tuple[recorder.RecordingTracerProvider, Kept], monkeypatch: pytest.MonkeyPatch
) -> None:
    made, kept = provider
    monkeypatch.setattr(tracing, "tracer", made.get_tracer("tether"))
    with tracing.server_span("tether.v1.Admission/Admit", ""):
        pass
    with pytest.raises(InvalidArgument), tracing.server_span("tether.v1.Admission/Admit", ""):
        raise InvalidArgument("no")
    with pytest.raises(Parked), tracing.span("parks", run_id="run_1", expected=(Parked,)):
        raise Parked
    with pytest.raises(KeyError), tracing.span("breaks"):
        raise KeyError("x")
    ok, refused, parked, broke = ended(made, kept)
    assert ok.attributes["rpc.grpc.status_code"] == 0
    assert refused.attributes["rpc.grpc.status_code"] == 3  # INVALID_ARGUMENT
    assert refused.status is None  # the caller's mistake is no server error
    assert parked.attributes["tether.outcome"] == "parked"
    assert parked.context.trace_id == tracing.run_root("run_1").trace_id
    assert broke.attributes["error.type"] == "KeyError"
    assert broke.status is not None and broke.status.status_code is StatusCode.ERROR
