"""What the worker tells telemetry: the attempt's span (current in its task and its
supervisor's), a span per model turn with the GenAI semantic conventions, per tool call and per
checkpoint, and each turn's tokens and cost. Only `attempt_context` runs while telemetry is
off: it binds the run to the attempt's log lines."""

from __future__ import annotations

import contextvars
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind

from services.worker.interactions import Parked
from tether import telemetry
from tether.domain import AgentConfig, Assignment, Batch, ToolCall
from tether.telemetry import metrics, tracing
from tether.telemetry.logs import bind_run

T = TypeVar("T")


def attempt_context(assignment: Assignment) -> tuple[contextvars.Context, Span | None]:
    """The context an attempt's task and its supervisor start in (each copies it): its run
    bound to their log lines and, while telemetry is on, the attempt's span current, a child of
    the context its lease carries. The span is the supervisor's to end (`attempt_ended`)."""
    context = contextvars.copy_context()
    return context, context.run(_enter_attempt, assignment)


def _enter_attempt(assignment: Assignment) -> Span | None:
    lease = assignment.lease
    bind_run(assignment.run_id, assignment.tenant_id, lease.attempt, assignment.traceparent)
    if not telemetry.on:
        return None
    attributes: dict[str, Any] = {
        "tether.run.id": assignment.run_id,
        "tether.tenant.id": assignment.tenant_id,
        "tether.attempt": lease.attempt,
        "tether.lease.epoch": lease.epoch,
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.agent.name": assignment.config.agent,
    }
    if tracing.content:
        attributes["tether.run.input"] = assignment.input_text
    span = tracing.tracer.start_span(
        "tether.attempt",
        context=tracing.run_context(assignment.traceparent, assignment.run_id),
        attributes=attributes,
    )
    otel_context.attach(trace.set_span_in_context(span))  # in the copied context only
    return span


def attempt_ended(span: Span, cancel_reason: str | None, error: BaseException | None) -> None:
    """End the attempt's span: how it stopped, when it did not simply report an outcome."""
    if cancel_reason is not None:
        span.set_attribute("tether.cancel_reason", cancel_reason)
    if error is not None:
        tracing.failed(span, error)
    span.end()


async def model_turn(config: AgentConfig, request: dict[str, Any], call: Awaitable[T]) -> T:
    """`call` (one streamed model turn) in its span: the GenAI attributes of the request and,
    once it ended, of its usage and finish reason."""
    model = config.model
    with tracing.span(
        f"chat {model}",
        kind=SpanKind.CLIENT,
        attributes={
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": "anthropic",
            "gen_ai.request.model": model,
            "gen_ai.request.max_tokens": request["max_tokens"],
        },
    ) as span:
        turn = await call
        usage: dict[str, int] = getattr(turn, "usage", {})
        for field, attribute in _USAGE_ATTRIBUTES.items():
            if field in usage:
                span.set_attribute(attribute, usage[field])
        stop_reason = getattr(turn, "stop_reason", None)
        if stop_reason:
            span.set_attribute("gen_ai.response.finish_reasons", [stop_reason])
        return turn


_USAGE_ATTRIBUTES = {
    "input_tokens": "gen_ai.usage.input_tokens",
    "output_tokens": "gen_ai.usage.output_tokens",
    "cache_creation_input_tokens": "gen_ai.usage.cache_creation.input_tokens",
    "cache_read_input_tokens": "gen_ai.usage.cache_read.input_tokens",
}


def turn_used(tenant_id: str, model: str, usage: dict[str, int], cost_micros: int) -> None:
    """A model turn's tokens and cost, for the tenant's and model's counters."""
    metrics.model_turn(tenant_id, model, usage, cost_micros)


@contextmanager
def tool_call(call: ToolCall) -> Iterator[Span]:
    """A tool call's span (its input only when content is opted in); a park ends it as how
    things go, not as a failure."""
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": call.name,
        "gen_ai.tool.call.id": call.tool_call_id,
    }
    if tracing.content:
        attributes["gen_ai.tool.call.arguments"] = tracing.json_attribute(dict(call.input))
    with tracing.span(
        f"execute_tool {call.name}", attributes=attributes, expected=(Parked,)
    ) as span:
        yield span


async def checkpoint(batch: Batch, call: Awaitable[T]) -> T:
    """`call` (one checkpoint written under the lease) in its span."""
    with tracing.span(
        "tether.checkpoint",
        attributes={
            "tether.checkpoint.batch": batch.number,
            "tether.checkpoint.parts": len(batch.parts),
            "tether.checkpoint.events": len(batch.events),
        },
    ):
        return await call


def traceparent() -> str:
    """The current span's context (the attempt's), for a request that ends the attempt."""
    return tracing.traceparent() if telemetry.on else ""
