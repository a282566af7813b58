"""What the orchestrator tells telemetry: a claim's span (the context its lease carries) and
latency, a resume's span linked to what resumed it, the moves runs make, the reaper's work,
retries by error class, and the queue's gauges. Called only while `tether.telemetry.on`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncEngine

from services.orchestrator.repositories import queue as queue_repo
from tether.domain import Run
from tether.states import RunStatus
from tether.telemetry import metrics, tracing


def claimed(run: Run, queued_at: datetime, routing_ms: float | None) -> str:
    """A run was leased (it was last moved before at `queued_at`; resolving its routing took
    `routing_ms` in this claim): its claim's span, a child of the run's stored trace context
    (from the claim statement to now), and its claim latency; returns the span's context,
    which the lease carries to the worker."""
    started_ns = int(run.updated_at.timestamp() * 1e9)  # the claim statement's now()
    queue_wait_s = (run.updated_at - queued_at).total_seconds()
    attributes = {
        "tether.run.id": run.run_id,
        "tether.tenant.id": run.tenant_id,
        "tether.attempt": run.attempt,
        "tether.lease.epoch": run.lease_epoch,
        "tether.worker.id": run.lease_owner,
        "tether.queue.wait_ms": round(queue_wait_s * 1000, 3),
    }
    with tracing.span(
        "tether.claim",
        parent=run.traceparent or "",
        run_id=run.run_id,
        attributes=attributes,
        start_time=started_ns,
    ):
        context = tracing.traceparent()
    metrics.claimed(queue_wait_s, routing_ms or 0.0, run.tenant_id)
    return context


def resumed(run: Run) -> None:
    """A parked run was queued again by an answer, a decision or a consent: a span of the run's
    trace, linked to the span of the call that resumed it (the current one: its own trace)."""
    with tracing.span(
        "tether.resume",
        parent=run.traceparent or "",
        run_id=run.run_id,
        attributes={"tether.run.id": run.run_id, "tether.tenant.id": run.tenant_id},
        links=tracing.link_to(tracing.traceparent()),
    ):
        pass


def moved(run: Run) -> None:
    """A run reached the status its row has now."""
    metrics.run_moved(run.status, run.tenant_id)


def reaped(run: Run) -> None:
    """The reaper moved a run whose lease lapsed: requeued it, or ended it."""
    if run.status == RunStatus.QUEUED.value:
        metrics.reaped("requeued")
        return
    metrics.reaped(run.status)
    metrics.run_moved(run.status, run.tenant_id)


def watch_queue(engine: AsyncEngine) -> Callable[[], Awaitable[float | None]]:
    """A round (for `tether.runtime.tasks.rounds`) that reads the queue's depth and oldest age
    for their gauges."""
    report = metrics.observe_queue()
    autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")

    async def read() -> float | None:
        async with autocommit.connect() as conn:
            depth, oldest_s = await queue_repo.queue_stats(conn)
        report(depth, oldest_s)
        return None  # every round's longest wait: the export interval

    return read
