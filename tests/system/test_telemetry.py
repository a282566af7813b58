"""Telemetry with the services as real processes, each exporting over OTLP to a collector this
test runs (`tether.testing.collector`): one trace per run across all five services, through a
pause and its resume; metrics that move as runs complete, fail and retry; JSON logs that carry
the run's ids; and no message text or tool input anywhere unless a setting opts in."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
import pytest_asyncio
from sqlalchemy import select, update

from tests.system.execution_support import ExecStack, events_of, exec_stack, wait_for_status
from tether.client import TetherClient
from tether.db.engine import create_engine
from tether.db.schema import tenants
from tether.testing.collector import Collector, ExportedSpan
from tether.testing.eventually import eventually
from tether.testing.model_server import ErrorTurn, TextTurn, ToolUseTurn

SERVICES = {
    "tether-gateway",
    "tether-admission",
    "tether-orchestrator",
    "tether-worker",
    "tether-interactions",
}
# The one tenant with a metric label of its own; every other tenant is counted as `other`.
LABELLED = f"t-labelled-{uuid.uuid4().hex[:6]}"
QUESTION = {"questions": [{"key": "size", "prompt": "Which size?", "options": ["S", "M"]}]}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def collector() -> AsyncIterator[Collector]:
    async with Collector() as running:
        yield running


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str,
    template_db: str,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
    collector: Collector,
) -> AsyncIterator[ExecStack]:
    run_dir = Path(tmp_path_factory.mktemp("telemetry"))
    env = {**collector.env(), "TETHER_TELEMETRY_TENANTS": LABELLED}
    async with exec_stack(
        pg_server_url, template_db, redis_url, run_dir, workers=1, extra_env=env
    ) as running:
        yield running


def trace_id_of(traceparent: str) -> str:
    assert traceparent.startswith("00-") and len(traceparent) == 55, traceparent
    return traceparent[3:35]


def by_id(spans: list[ExportedSpan]) -> dict[str, ExportedSpan]:
    return {s.span_id: s for s in spans}


async def test_one_trace_covers_a_run_through_a_question_and_its_resume(
    stack: ExecStack, collector: Collector
) -> None:
    tenant = await stack.tenant()
    text = f"ask me the size {uuid.uuid4().hex}"
    stack.model.script(text, [ToolUseTurn("ask_questions", QUESTION), TextTurn("Size M it is.")])
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "waiting-for-question")
    async with TetherClient(stack.addr("gateway"), tenant.api_key) as client:
        assert (await client.answer(run_id, {"size": ["M"]})).resumed
    run = await wait_for_status(stack.db_url, run_id, "completed")
    trace_id = trace_id_of(run.traceparent)

    def attempts() -> list[ExportedSpan]:
        return [s for s in collector.trace(trace_id) if s.name == "tether.attempt"]

    async def whole() -> list[ExportedSpan] | None:
        spans = collector.trace(trace_id)
        services = {s.service for s in spans}
        completes = [s for s in spans if s.name == "tether.complete"]
        return spans if services >= SERVICES and len(attempts()) == 2 and completes else None

    spans = await eventually(whole, timeout=20, what="the run's spans from all five services")
    assert {s.service for s in spans} == SERVICES
    assert {s.trace_id for s in collector.spans_about(run_id)} == {trace_id}, (
        "every span about the run is in its trace"
    )
    index = by_id(spans)
    # The gateway's call is the root; admission's span is what the run was stored with.
    send = next(s for s in spans if s.name.endswith("GatewayService/SendMessage"))
    assert send.parent_span_id == "" and send.service == "tether-gateway"
    admit = index[run.traceparent[36:52]]
    assert admit.service == "tether-admission" and admit.parent_span_id == send.span_id
    # Each attempt, the one after the resume too, is a child of its claim, a child of admission.
    first, resumed = sorted(attempts(), key=lambda s: s.start_ns)
    for attempt in (first, resumed):
        claim = index[attempt.parent_span_id]
        assert claim.name == "tether.claim" and claim.service == "tether-orchestrator"
        assert claim.parent_span_id == admit.span_id
        assert attempt.attributes["tether.run.id"] == run_id
    # The first attempt asked (a tool span whose call reached interactions) and parked.
    children = [s for s in spans if s.parent_span_id == first.span_id]
    ask = next(s for s in children if s.name == "execute_tool ask_questions")
    assert ask.attributes["tether.outcome"] == "parked"
    raised = [s for s in spans if s.service == "tether-interactions"]
    assert raised and all(index.get(s.parent_span_id) for s in raised)
    park = next(s for s in spans if s.name == "tether.park")
    assert park.parent_span_id == first.span_id and park.service == "tether-orchestrator"
    # The model turns carry the GenAI attributes.
    turns = [s for s in spans if s.name.startswith("chat ")]
    assert len(turns) == 2
    for turn in turns:
        assert turn.attributes["gen_ai.operation.name"] == "chat"
        assert turn.attributes["gen_ai.request.model"]
        assert turn.attributes["gen_ai.usage.input_tokens"] > 0
        assert turn.attributes["gen_ai.usage.output_tokens"] > 0
    finishes = sorted(tuple(t.attributes["gen_ai.response.finish_reasons"]) for t in turns)
    assert finishes == [("end_turn",), ("tool_use",)]
    # The completion is the orchestrator's span under the attempt that sent it.
    complete = next(s for s in spans if s.name == "tether.complete")
    assert complete.parent_span_id == resumed.span_id
    # The resume is a span of the run's trace, linked to the answer that caused it (which is a
    # trace of its own: the answering client's call through gateway and interactions).
    resume = next(s for s in spans if s.name == "tether.resume")
    assert resume.parent_span_id == admit.span_id
    ((linked_trace, linked_span),) = resume.links
    assert linked_trace != trace_id

    async def answered() -> dict[str, ExportedSpan] | None:
        spans = by_id(collector.trace(linked_trace))
        names = [s.name for s in spans.values()]
        calls = any(n.endswith("GatewayService/AnswerQuestion") for n in names)
        return spans if linked_span in spans and calls else None

    answer = await eventually(answered, timeout=20, what="the answer's spans")
    assert answer[linked_span].name.endswith("OrchestratorService/ResumeRun")


async def test_a_run_retried_after_a_provider_error_stays_in_one_trace(
    stack: ExecStack, collector: Collector
) -> None:
    tenant = await stack.tenant()
    text = f"overloaded once {uuid.uuid4().hex}"
    stack.model.script(text, [ErrorTurn(529), TextTurn("Fine now.")])
    run_id = await tenant.send(text)
    run = await wait_for_status(stack.db_url, run_id, "completed")
    trace_id = trace_id_of(run.traceparent)

    async def both() -> list[ExportedSpan] | None:
        spans = collector.trace(trace_id)
        attempts = [s for s in spans if s.name == "tether.attempt"]
        retried = any(s.name == "tether.schedule_retry" for s in spans)
        return attempts if len(attempts) == 2 and retried else None

    attempts = await eventually(both, timeout=20, what="both attempts' spans and the retry's")
    assert sorted(s.attributes["tether.attempt"] for s in attempts) == [1, 2]
    retry = next(s for s in collector.trace(trace_id) if s.name == "tether.schedule_retry")
    first = next(s for s in attempts if s.attributes["tether.attempt"] == 1)
    assert retry.parent_span_id == first.span_id


async def test_a_message_sent_over_http_continues_the_callers_trace(
    stack: ExecStack, collector: Collector
) -> None:
    tenant = await stack.tenant()
    text = f"over http {uuid.uuid4().hex}"
    stack.model.script(text, [TextTurn("Hello over HTTP.")])
    caller_trace, caller_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    headers = {
        "Authorization": f"Bearer {tenant.api_key}",
        "traceparent": f"00-{caller_trace}-{caller_span}-01",
    }
    url = f"http://{stack.services.http_addresses()['gateway']}/v1/messages"
    async with httpx2.AsyncClient(timeout=30) as http:
        response = await http.post(
            url,
            json={"text": text, "conversation_id": uuid.uuid4().hex, "event_id": uuid.uuid4().hex},
            headers=headers,
        )
    assert response.status_code == 200, response.text
    run_id = response.json()["run"]["run_id"]
    run = await wait_for_status(stack.db_url, run_id, "completed")
    assert trace_id_of(run.traceparent) == caller_trace

    async def served() -> list[ExportedSpan] | None:
        spans = collector.trace(caller_trace)
        posts = [s for s in spans if s.name == "POST /v1/messages"]
        return posts if posts and any(s.name == "tether.attempt" for s in spans) else None

    (post,) = await eventually(served, timeout=20, what="the request's and attempt's spans")
    assert post.parent_span_id == caller_span and post.service == "tether-gateway"
    assert post.attributes["http.response.status_code"] == 200


async def test_an_attempt_after_a_lapsed_lease_is_in_the_runs_trace_and_the_reap_is_counted(
    stack: ExecStack, collector: Collector
) -> None:
    tenant = await stack.tenant()
    text = f"slow then recovered {uuid.uuid4().hex}"
    stack.model.script(text, [ToolUseTurn("slow_task", {"seconds": 60}), TextTurn("Recovered.")])
    expirations = collector.total("tether.lease.expirations")
    requeued = collector.total("tether.reaps", tether__reap__outcome="requeued")
    run_id = await tenant.send(text)

    async def tool_started() -> bool:
        return "tool.started" in [t for _, t, _ in await events_of(stack.db_url, run_id)]

    await eventually(tool_started, timeout=20, what="the slow tool to start")
    stack.services.kill("worker")  # SIGKILL: the lease lapses and the reaper requeues the run
    await stack.start_worker()
    run = await wait_for_status(stack.db_url, run_id, "completed")
    trace_id = trace_id_of(run.traceparent)

    async def reaped_and_traced() -> list[ExportedSpan] | None:
        claims = [s for s in collector.trace(trace_id) if s.name == "tether.claim"]
        attempts = [s for s in collector.trace(trace_id) if s.name == "tether.attempt"]
        counted = (
            collector.total("tether.lease.expirations") > expirations
            and collector.total("tether.reaps", tether__reap__outcome="requeued") > requeued
        )
        return attempts if len(claims) == 2 and attempts and counted else None

    # The killed worker never exported its attempt; the one after the reap is in the trace.
    (after,) = await eventually(reaped_and_traced, timeout=20, what="the reap and the retry")
    assert after.attributes["tether.attempt"] == 2
    assert collector.total("tether.lease.expirations") == expirations + 1


def counts(collector: Collector) -> dict[str, float]:
    """The counters and histogram counts the metrics test watches, as they stand."""
    runs = "tether.runs"
    return {
        "completed": collector.total(
            runs, tether__run__status="completed", tether__tenant=LABELLED
        ),
        "failed": collector.total(runs, tether__run__status="failed", tether__tenant=LABELLED),
        "other": collector.total(runs, tether__run__status="completed", tether__tenant="other"),
        "retries": collector.total("tether.retries", tether__tenant=LABELLED),
        "admissions": collector.total("tether.admissions", tether__tenant=LABELLED),
        "claims": collector.total("tether.claim.latency", tether__tenant=LABELLED),
        "totals": collector.total("tether.stage.duration", tether__stage="total"),
        "tokens": collector.total("tether.tokens", tether__tenant=LABELLED),
        "cost": collector.total("tether.cost", tether__tenant=LABELLED),
    }


async def test_metrics_move_when_runs_complete_fail_and_retry(
    stack: ExecStack, collector: Collector
) -> None:
    labelled = await stack.tenant(tenant_id=LABELLED)
    other = await stack.tenant()
    before = counts(collector)
    ok, bad, flaky, theirs = (
        f"{label} {uuid.uuid4().hex}" for label in ("ok", "bad", "flaky", "x")
    )
    stack.model.script(ok, [TextTurn("Done.")])
    stack.model.script(bad, [ErrorTurn(400)])
    stack.model.script(flaky, [ErrorTurn(529), TextTurn("Done after a retry.")])
    stack.model.script(theirs, [TextTurn("Done for them.")])
    runs = [await labelled.send(t) for t in (ok, bad, flaky)] + [await other.send(theirs)]
    for run_id, status in zip(runs, ["completed", "failed", "completed", "completed"], strict=True):
        await wait_for_status(stack.db_url, run_id, status)
    # Four runs, one of them claimed twice; every completion reports its stage durations.
    want = {"completed": 2, "failed": 1, "other": 1, "retries": 1, "admissions": 3, "claims": 4}

    async def moved() -> dict[str, float] | None:
        now = counts(collector)
        delta = {k: now[k] - before[k] for k in now}
        done = all(delta[k] >= v for k, v in want.items()) and delta["totals"] >= 4
        return delta if done else None

    delta = await eventually(moved, timeout=20, what="the run metrics to move")
    assert {k: delta[k] for k in want} == want
    assert delta["tokens"] > 0 and delta["cost"] >= 0
    retried = [p for p in collector.received.points if p.name == "tether.retries" and p.value]
    assert {p.attributes["error.type"] for p in retried} == {"provider_overloaded"}
    labels = {p.attributes.get("tether.tenant") for p in collector.received.points}
    assert labels - {None} <= {LABELLED, "other"}, "a tenant off the allow-list is `other`"
    depth = collector.latest("tether.queue.depth")
    assert depth is not None and depth.service == "tether-orchestrator"
    assert collector.latest("tether.queue.oldest_age") is not None
    assert collector.latest("tether.stream.subscribers") is not None


def log_lines(stack: ExecStack) -> list[dict[str, Any]]:
    """Every line every service logged, each parsed (every one is a JSON object)."""
    lines = []
    for proc in stack.services.procs.values():
        lines.extend(json.loads(line) for line in proc.log_path.read_text().splitlines())
    return lines


async def allow_unknown_tool(stack: ExecStack, tenant_id: str, tool: str) -> None:
    """Name a tool no registry has in the tenant's allowlist (the worker warns, per attempt)."""
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.begin() as conn:
            agent = (
                await conn.execute(select(tenants.c.agent).where(tenants.c.tenant_id == tenant_id))
            ).scalar_one()
            agent = {**agent, "tool_allowlist": [*agent["tool_allowlist"], tool]}
            await conn.execute(
                update(tenants).where(tenants.c.tenant_id == tenant_id).values(agent=agent)
            )
    finally:
        await engine.dispose()


async def test_logs_are_json_lines_carrying_the_run_and_its_trace(stack: ExecStack) -> None:
    tenant = await stack.tenant()
    await allow_unknown_tool(stack, tenant.tenant_id, "no_such_tool")
    text = f"hello {uuid.uuid4().hex}"
    stack.model.script(text, [TextTurn("Hello.")])
    run_id = await tenant.send(text)
    run = await wait_for_status(stack.db_url, run_id, "completed")

    async def warned() -> dict[str, Any] | None:
        about = [x for x in log_lines(stack) if x.get("run_id") == run_id]
        return next((x for x in about if "no_such_tool" in x["message"]), None)

    line = await eventually(warned, what="the worker's warning about the run")
    assert line["service"] == "worker" and line["level"] == "WARNING"
    assert (line["tenant_id"], line["attempt"]) == (tenant.tenant_id, 1)
    assert line["trace_id"] == trace_id_of(run.traceparent)
    assert len(line["span_id"]) == 16, "the attempt's span, current while it logged"


async def test_text_and_tool_inputs_stay_out_of_spans_and_logs_unless_opted_in(
    stack: ExecStack, collector: Collector
) -> None:
    async def run_with_secrets() -> tuple[str, str, str]:
        tenant = await stack.tenant()
        text, note = f"private {uuid.uuid4().hex}", f"note-{uuid.uuid4().hex}"
        stack.model.script(text, [ToolUseTurn("get_time", {"note": note}), TextTurn("It is late.")])
        run_id = await tenant.send(text)
        await wait_for_status(stack.db_url, run_id, "completed")

        async def exported() -> bool:
            names = {s.name for s in collector.spans_about(run_id)}
            return {"tether.complete", "tether.attempt"} <= names

        await eventually(exported, timeout=20, what="the run's spans")
        return run_id, text, note

    _, text, note = await run_with_secrets()
    spans = json.dumps([[s.name, s.attributes] for s in collector.spans])
    logs = json.dumps(log_lines(stack))
    for secret in (text, note):
        assert secret not in spans and secret not in logs

    # A worker that opts in records the run's input and the tool's on its spans.
    await stack.services.stop("worker")
    await stack.start_worker(TETHER_TELEMETRY_CONTENT="true")
    try:
        run_id, text, note = await run_with_secrets()
        recorded = json.dumps([s.attributes for s in collector.spans_about(run_id)])
        tools = [s for s in collector.spans if s.name == "execute_tool get_time"]
        recorded += json.dumps([s.attributes for s in tools])
        assert text in recorded and note in recorded
    finally:
        await stack.services.stop("worker")
        await stack.start_worker()
