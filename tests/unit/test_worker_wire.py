"""The worker's two clients: a claim becomes an Assignment, domain progress and endings become
their requests, and a tool call's idempotency key does not depend on the way its input came."""

from __future__ import annotations

import json
from typing import Any

import pytest
from google.protobuf import json_format

from services.worker.drafts import ToolCallDraft
from services.worker.interactions import approval_claim_from_proto
from services.worker.tools.base import CallContext, ToolContext, ToolOutput, ToolSpec
from services.worker.tools.registry import ToolRegistry
from tether.convert import event_to_wire, part_to_proto
from tether.convert.work import assignment_from_proto, checkpoint_to_proto, completion_to_proto
from tether.domain import (
    ApprovalMarker,
    Batch,
    Cancelled,
    Completed,
    Completion,
    ConnectionMarker,
    EffectState,
    Event,
    EventType,
    Failed,
    Interruption,
    Lease,
    Limits,
    ModelTurn,
    Part,
    QuestionMarker,
    Role,
    RunError,
    Summary,
    SystemBlock,
    Text,
    Thinking,
    ToolCall,
    ToolResult,
    context_compacted,
    interaction_event,
    interrupted_results,
    part_added,
    part_from_json,
    part_json,
    part_superseded,
    part_updated,
    run_cancelled,
    run_completed,
    run_failed,
    run_queued,
    run_retry_pending,
    run_started,
    text_delta,
    tool_completed,
    tool_failed,
    tool_started,
    usage_updated,
)
from tether.pricing import Price
from tether.v1 import common_pb2, events_pb2, interactions_pb2, orchestrator_pb2

LEASE = Lease("run_1", 7, 2)
CALL = Part(
    4,
    Role.ASSISTANT,
    ToolCall("toolu_1", "post", {"text": "hi", "n": 3, "deep": {"list": [1, 2.5, None, True]}}),
    final=True,
)
PARTS = [
    Part(0, Role.ASSISTANT, Text()),
    Part(1, Role.ASSISTANT, Text("Hello"), final=True),
    Part(2, Role.ASSISTANT, Thinking("hm", "sig"), final=True),
    Part(3, Role.ASSISTANT, ToolCall("toolu_0", "get_time")),
    CALL,
    Part(5, Role.TOOL, ToolResult("toolu_1", "cut", True, "out_1", True), final=True),
    Part(6, Role.ASSISTANT, QuestionMarker("int_q"), final=True),
    Part(7, Role.ASSISTANT, ApprovalMarker("int_a", "post"), final=True),
    Part(8, Role.ASSISTANT, ConnectionMarker("int_c", "github"), final=True),
    Part(9, Role.ASSISTANT, Summary("they talked", "run_a", "run_b", 2, 7, 9000, 1200), final=True),
]
TURN = ModelTurn("claude-test", 100, 20, 0, 7, cost_micros=123)
EVENTS = [
    *(part_added(p) for p in PARTS),
    *(part_updated(p) for p in PARTS),
    tool_started("toolu_1", "post"),
    tool_completed("toolu_1", "post"),
    tool_completed("toolu_1", "post", replayed=True),
    tool_failed("toolu_1", "post", RunError("tool_error", "refused")),
    usage_updated(TURN, {"input_tokens": 100, "output_tokens": 20, "cost_micros": 123}),
    *interrupted_results([CALL], Interruption.RUN_FAILED, 9)[1],
    text_delta(1, "lo", 3),
    # What the other senders put on the wire (the interactions service) and the orchestrator
    # stores: the same encoder must hold for them.
    interaction_event(EventType.QUESTION_ANSWERED, "int_q"),
    interaction_event(EventType.APPROVAL_DECIDED, "int_a", decision="allow-once"),
    interaction_event(EventType.CONNECTION_COMPLETED, "int_c", outcome="expired"),
    run_queued(2, "retry"),
    run_started(1, "w-1", 3),
    run_failed(RunError("x", "y", retryable=True, provider_status=529)),
    run_retry_pending(1, 3, "2026-12-02T10:00:00.250Z", RunError("overloaded")),
    run_completed(Completed("done", warnings=("max_tokens",)), {"input_tokens": 5}),
    run_cancelled("cancelled by caller"),
    part_superseded(4, 2),
    context_compacted(9, Summary("they talked", "run_a", "run_b", 2, 7, 9000, 1200)),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: str(e.type))
def test_every_event_is_encoded_as_protobuf_parses_it(event: Event) -> None:
    parsed = events_pb2.RunEvent(type=event.type)
    getattr(parsed, event.type.field).SetInParent()
    json_format.ParseDict(dict(event.payload), getattr(parsed, event.type.field))
    assert event_to_wire(event) == parsed


def test_a_claim_becomes_an_assignment_with_domain_history() -> None:
    response = orchestrator_pb2.ClaimRunResponse(
        claimed=True,
        lease=orchestrator_pb2.Lease(run_id="run_1", epoch=7, attempt=2),
        run=common_pb2.Run(run_id="run_1", tenant_id="t", input_text="post it"),
        config=orchestrator_pb2.AgentConfig(
            model="claude-test",
            system_blocks=[orchestrator_pb2.SystemBlock(text="Be brief.", cache_control="e")],
            tool_allowlist=["post"],
            limits=orchestrator_pb2.Limits(max_steps=4, wall_clock_seconds=2.5),
            prices=[orchestrator_pb2.ModelPrice(model="claude-test", input=1, output=2)],
        ),
        history=[part_to_proto(p) for p in PARTS[:3]],
        prior_part_count=1,
        last_seq=12,
        traceparent="00-abc-def-01",
    )
    assignment = assignment_from_proto(response)
    assert assignment.lease == LEASE
    assert (assignment.tenant_id, assignment.input_text) == ("t", "post it")
    assert assignment.root_run_id == "run_1", "a run without a lineage is its own root"
    assert assignment.config.system_blocks == (SystemBlock("Be brief.", "e"),)
    assert assignment.config.tool_allowlist == ("post",)
    assert assignment.config.limits == Limits(max_steps=4, wall_clock_seconds=2.5)
    assert assignment.config.prices == {"claude-test": Price(1, 2, 0, 0)}
    assert list(assignment.prior) == PARTS[:1]
    assert list(assignment.own) == PARTS[1:3]
    assert (assignment.last_seq, assignment.traceparent) == (12, "00-abc-def-01")


def test_a_checkpoint_carries_its_batch_number_parts_events_and_turns() -> None:
    batch = Batch(3, (PARTS[1],), (tool_started("toolu_1", "post"),), (TURN,))
    request = checkpoint_to_proto(LEASE, batch)
    assert (request.run_id, request.epoch, request.batch) == ("run_1", 7, 3)
    assert [w.part for w in request.parts] == [part_to_proto(PARTS[1])]
    assert [e.type for e in request.events] == ["tool.started"]
    assert request.turns[0] == common_pb2.Usage(
        model="claude-test",
        input_tokens=100,
        output_tokens=20,
        cache_read_input_tokens=7,
        cost_micros=123,
    )


def test_each_ending_becomes_its_completion_with_the_batch_in_flight() -> None:
    rest = Batch(0, (PARTS[1],), (), ())
    in_flight = Batch(4, (PARTS[2],), (tool_started("toolu_1", "post"),), ())
    stages = {"attempt_ms": 5.0, "total_ms": 9.0, "own_timing_ms": 1.0}

    done = completion_to_proto(
        LEASE,
        Completion(
            Completed("Hello", "unresolved", ("max_steps_exceeded",)),
            parts=rest.parts,
            stages=stages,
            in_flight=in_flight,
        ),
    )
    assert done.status == common_pb2.RUN_STATUS_COMPLETED
    assert (done.result_text, done.task_outcome) == ("Hello", "unresolved")
    assert list(done.warnings) == ["max_steps_exceeded"]
    assert not done.HasField("error")
    assert [w.part for w in done.parts] == [part_to_proto(PARTS[1])]
    assert done.in_flight == checkpoint_to_proto(LEASE, in_flight)
    assert (done.stages.attempt_ms, done.stages.total_ms) == (5.0, 9.0)

    failed = completion_to_proto(
        LEASE, Completion(Failed(RunError("bad", "no", True, 400)), parts=rest.parts)
    )
    assert failed.status == common_pb2.RUN_STATUS_FAILED
    assert failed.error == common_pb2.ErrorInfo(
        code="bad", message="no", retryable=True, provider_status=400
    )
    assert not failed.HasField("in_flight")

    cancelled = completion_to_proto(LEASE, Completion(Cancelled("by caller"), parts=rest.parts))
    assert cancelled.status == common_pb2.RUN_STATUS_CANCELLED
    assert cancelled.error == common_pb2.ErrorInfo(code="cancelled", message="by caller")


# -- one tool call, three ways in, one key ------------------------------------------------------


class Publish:
    """A tool that writes externally, with every kind of number in its schema."""

    spec = ToolSpec(
        name="post",
        description="Publish.",
        input_schema={
            "type": "object",
            "properties": {
                "count": {"type": "integer"},
                "amount": {"type": "number"},
                "window": {"type": "object", "properties": {"days": {"type": "integer"}}},
                "ratios": {"type": "array", "items": {"type": "number"}},
            },
        },
        writes_externally=True,
    )

    async def run(self, ctx: ToolContext, input: dict[str, Any]) -> ToolOutput:
        return ToolOutput("posted")


class KeyRecorder:
    """The effects record, keeping the keys it was asked to begin."""

    def __init__(self) -> None:
        self.keys: list[str] = []

    async def begin(self, key: str, tool_name: str) -> tuple[EffectState, dict[str, Any] | None]:
        self.keys.append(key)
        return EffectState.BEGUN, None

    async def finish(self, key: str, result: dict[str, Any]) -> None:
        pass


async def _key(registry: ToolRegistry, input: dict[str, Any]) -> str:
    effects = KeyRecorder()
    await registry.execute(
        "post",
        input,
        CallContext("t", "run_1", "run_0", "toolu_1"),
        effects=effects,
        allowlist=["post"],
        max_inline_bytes=1000,
        output_ref="out_1",
    )
    (key,) = effects.keys
    return key


async def test_a_calls_key_is_the_same_streamed_stored_or_approved() -> None:
    registry = ToolRegistry([Publish()])
    sdk_json = '{"count": 3, "amount": 5, "window": {"days": 7}, "ratios": [1, 0.5]}'

    # Streamed: the SDK's partial JSON, whose numbers parse as ints.
    draft = ToolCallDraft("toolu_1", "post", {})
    draft.extend(sdk_json[:20])
    draft.extend(sdk_json[20:])
    streamed = draft.freeze(final=True)
    assert isinstance(streamed.content, ToolCall)

    # Stored: the part as the orchestrator keeps it (JSON), handed back by the next claim.
    row = json.loads(json.dumps(part_json(streamed)))
    claim = orchestrator_pb2.ClaimRunResponse(
        claimed=True,
        lease=orchestrator_pb2.Lease(run_id="run_1", epoch=1),
        history=[part_to_proto(part_from_json(row))],
    )
    (stored,) = assignment_from_proto(claim).own
    assert isinstance(stored.content, ToolCall)

    # Approved: the normalised input the person was shown, stored by the interactions service.
    normalised, problem = registry.validate_input("post", dict(streamed.content.input))
    assert problem == ""
    response = interactions_pb2.ClaimApprovalResponse(claimed=True, tool_name="post")
    json_format.ParseDict(normalised, response.input)
    approved = approval_claim_from_proto(response)

    keys = {
        await _key(registry, dict(streamed.content.input)),
        await _key(registry, dict(stored.content.input)),
        await _key(registry, dict(approved.input)),
    }
    assert len(keys) == 1
    # Why the part keeps doubles: the SDK's raw input would name another effect.
    assert await _key(registry, json.loads(sdk_json)) not in keys
