"""Spans and the trace context that ties a run's spans into one trace.

One trace per run: the gateway's call starts it (or continues the caller's), admission stores
its own span's context on the run (`runs.traceparent`), and everything later descends from that
stored context however much later it happens: each claim's span is its child, the claim's
context rides the lease to the worker (`ClaimRunResponse.traceparent`), the attempt's rides its
completion back (`CompleteRunRequest.traceparent`, and the park, retry and release requests),
and unary calls carry it as `traceparent` gRPC metadata. A run stored without one (admitted
while telemetry was off) gets a trace id derived from its run id, so its spans still share one.
A resume is a span of the run's trace linked to the answer or decision that caused it.

Everything here is called only while `tether.telemetry.on` is True.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)

from tether.errors import TetherError

# The gRPC metadata key of the W3C trace context (lower case, as gRPC requires).
TRACEPARENT = "traceparent"
# Statuses that are the server's failure, not the caller's mistake (an ERROR span status).
_SERVER_FAULTS = frozenset(
    {
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)

tracer = trace.get_tracer("tether")
"""Tether's tracer: a proxy until `setup.configure` installs the provider."""

content = False
"""Whether spans may carry message text, model output and tool inputs (set by `configure`
from TETHER_TELEMETRY_CONTENT)."""


# -- the trace context as text -----------------------------------------------------------------


def traceparent_of(span_context: SpanContext) -> str:
    """`span_context` as a W3C traceparent; empty for an invalid one."""
    if not span_context.is_valid:
        return ""
    flags = int(span_context.trace_flags)
    return f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-{flags:02x}"


def traceparent() -> str:
    """The current span's context as a W3C traceparent; empty when no span is current."""
    return traceparent_of(trace.get_current_span().get_span_context())


def parse(traceparent: str) -> SpanContext | None:
    """A W3C traceparent as a remote span context; None when it is not one."""
    parts = traceparent.split("-")
    if len(parts) != 4 or len(parts[0]) != 2 or parts[0] == "ff":
        return None
    version, trace_hex, span_hex, flags_hex = parts
    if len(trace_hex) != 32 or len(span_hex) != 16 or len(flags_hex) != 2:
        return None
    try:
        trace_id, span_id, flags = int(trace_hex, 16), int(span_hex, 16), int(flags_hex, 16)
        int(version, 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags & 1))


def run_root(run_id: str) -> SpanContext:
    """The context a run's spans descend from when it was stored without one: ids derived from
    the run id, so every span of the run still shares one trace."""
    digest = hashlib.sha256(run_id.encode()).digest()
    return SpanContext(
        int.from_bytes(digest[:16]) or 1,
        int.from_bytes(digest[16:24]) or 1,
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
    )


def run_context(traceparent: str, run_id: str) -> otel_context.Context:
    """The context a run's span is started in: its stored trace context, else its run root."""
    parent = parse(traceparent) or run_root(run_id)
    return trace.set_span_in_context(NonRecordingSpan(parent))


def continuing(traceparent: str) -> otel_context.Context | None:
    """The context a span continuing `traceparent` (a caller's) starts in; None (a child of the
    current span, or a new trace) when it names no span."""
    parent = parse(traceparent)
    return None if parent is None else trace.set_span_in_context(NonRecordingSpan(parent))


def current_ids() -> tuple[str, str] | None:
    """The current span's (trace id, span id) in hex, for a log line; None without one."""
    span_context = trace.get_current_span().get_span_context()
    if not span_context.is_valid:
        return None
    return f"{span_context.trace_id:032x}", f"{span_context.span_id:016x}"


def link_to(traceparent: str) -> list[Link]:
    """A link to the span `traceparent` names (none when it names none)."""
    linked = parse(traceparent)
    return [] if linked is None else [Link(linked)]


# -- gRPC ----------------------------------------------------------------------------------------


def incoming(context: grpc.aio.ServicerContext) -> str:
    """The traceparent a unary call's caller sent as metadata; empty when none."""
    for key, value in context.invocation_metadata() or ():
        if key == TRACEPARENT and isinstance(value, str):
            return value
    return ""


def outgoing(metadata: Sequence[tuple[str, str]] | None) -> Sequence[tuple[str, str]] | None:
    """`metadata` with the current span's context added, for a unary call to another service."""
    current = traceparent()
    if not current:
        return metadata
    return (*(metadata or ()), (TRACEPARENT, current))


def traced_unary(
    behavior: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]], method: str
) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
    """`behavior` (the unary method `service/name`) run in its `server_span`, continuing the
    trace its caller sent."""

    async def traced(request: Any, context: grpc.aio.ServicerContext) -> Any:
        with server_span(method, incoming(context)):
            return await behavior(request, context)

    return traced


def server_span(method: str, traceparent: str) -> Block:
    """A server span for one call of the RPC `method` (`service/name`), current inside the
    block, continuing the caller's trace context `traceparent`: the RPC's name and status code,
    never its request or its error message."""
    service, _, name = method.partition("/")
    started = tracer.start_span(
        method,
        context=continuing(traceparent),
        kind=SpanKind.SERVER,
        attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
    )
    return Block(started, ok={"rpc.grpc.status_code": 0})


class Block:
    """A started span, current inside a `with` block and ended by it. An exception escaping
    the block is recorded by type (`failed`), unless it is one of the `expected` ones (a park:
    how things go, not a failure), which is named in `tether.outcome`; a block that ends
    without one sets the `ok` attributes. (A class, not a generator: a span's block is on
    every run's path, and this is a third of the generator's cost.)"""

    __slots__ = ("_expected", "_ok", "_span", "_token")

    def __init__(
        self,
        started: Span,
        expected: tuple[type[BaseException], ...] = (),
        ok: dict[str, Any] | None = None,
    ) -> None:
        self._span = started
        self._expected = expected
        self._ok = ok
        self._token: object = None

    def __enter__(self) -> Span:
        self._token = otel_context.attach(trace.set_span_in_context(self._span))
        return self._span

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _: Any) -> None:
        current = self._span
        otel_context.detach(self._token)  # type: ignore[arg-type]  # what attach returned
        if exc is None:
            if self._ok:
                current.set_attributes(self._ok)
        elif isinstance(exc, self._expected):
            current.set_attribute("tether.outcome", type(exc).__name__.lower())
        else:
            failed(current, exc)
        current.end()


def failed(span: Span, exc: BaseException) -> None:
    """Record on `span` how it failed: the status and stable code of a TetherError (an ERROR
    status only when the fault is the server's), the type of anything else. Never the message:
    it may quote what a caller sent."""
    if isinstance(exc, TetherError):
        span.set_attribute("rpc.grpc.status_code", exc.status.value[0])
        span.set_attribute("error.type", exc.code)
        if exc.status in _SERVER_FAULTS:
            span.set_status(Status(StatusCode.ERROR, exc.code))
        return
    span.set_attribute("error.type", type(exc).__qualname__)
    span.set_status(Status(StatusCode.ERROR, type(exc).__qualname__))


def span(
    name: str,
    *,
    parent: str = "",
    run_id: str = "",
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: dict[str, Any] | None = None,
    links: Sequence[Link] = (),
    start_time: int | None = None,
    expected: tuple[type[BaseException], ...] = (),
) -> Block:
    """A span, current inside the block: a child of the trace context `parent` names (with
    `run_id`, of the run's root when it names none), else of the current span. An exception
    escaping the block is recorded by type (`failed`), unless it is one of the `expected` ones
    (a park: how things go, not a failure), which is named in `tether.outcome`."""
    context = run_context(parent, run_id) if run_id else continuing(parent)
    started = tracer.start_span(
        name,
        context=context,
        kind=kind,
        attributes=attributes,
        links=links,
        start_time=start_time,
        record_exception=False,
        set_status_on_exception=False,
    )
    return Block(started, expected)


def json_attribute(value: Any) -> str:
    """A structured value as a span attribute (only ever recorded when `content` is on)."""
    return json.dumps(value, ensure_ascii=False, default=str, sort_keys=True)
