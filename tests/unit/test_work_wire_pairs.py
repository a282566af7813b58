"""The Work stream's wire pairs (tether.convert.work): what the worker encodes, the orchestrator
decodes to what was sent, for every message, with every field set; what the orchestrator alone
decides is overridden, and a caller's mistake is refused."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from services.orchestrator.model_limit_edge import model_limit_writes
from services.orchestrator.rate_limits import ModelLimits
from services.orchestrator.worker_edge import ExecutionServicer
from tether.convert.render import (
    render_job_from_proto,
    render_job_to_proto,
    rendered_from_proto,
    rendered_to_proto,
)
from tether.convert.work import (
    OUTCOMES,
    STAGES,
    WRITE_FIELDS,
    assignment_from_proto,
    assignment_to_proto,
    checkpoint_from_proto,
    checkpoint_to_proto,
    completion_from_proto,
    completion_to_proto,
    effect_from_proto,
    effect_to_proto,
    ending_from_proto,
    ending_to_proto,
    ends_lease,
    write_request,
)
from tether.domain import (
    AgentConfig,
    Assignment,
    Batch,
    Cancelled,
    Completed,
    Completion,
    EarlierRun,
    EffectState,
    EndedChild,
    Ending,
    Failed,
    FoundDocument,
    Lease,
    Limits,
    ModelTurn,
    Origin,
    Part,
    Rendered,
    RenderJob,
    ReplyTarget,
    Role,
    RunError,
    Summary,
    SystemBlock,
    Text,
    ToolCall,
    ToolResult,
    part_added,
    text_delta,
    tool_completed,
    tool_failed,
    tool_started,
)
from tether.errors import InvalidArgument
from tether.v1 import common_pb2, orchestrator_pb2

LEASE = Lease("run_1", 7, 2)
PARTS = (
    Part(3, Role.ASSISTANT, Text("Hello"), final=True),
    Part(4, Role.ASSISTANT, ToolCall("toolu_1", "post", {"text": "hi", "n": 3.0}), final=True),
    Part(5, Role.TOOL, ToolResult("toolu_1", "cut", True, "out_1", True), final=True),
)
TURN = ModelTurn("claude-test", 100, 20, 3, 7)
EVENTS = (
    part_added(PARTS[0]),
    tool_started("toolu_1", "post"),
    tool_failed("toolu_1", "post", RunError("tool_error", "refused", True, 0)),
    tool_completed("toolu_1", "post", replayed=True),
)
BATCH = Batch(4, PARTS, EVENTS, (TURN,))
ENDINGS: tuple[Ending, ...] = (
    Completed("Hello", "unresolved", ("max_steps_exceeded", "max_tokens")),
    Failed(RunError("provider_overloaded", "try later", retryable=True, provider_status=529)),
    Cancelled("the caller changed their mind"),
)


def test_an_assignment_comes_back_as_sent() -> None:
    summary = Summary("they talked", "run_a", "run_b", 2, 7, 9000, 1200)
    assignment = Assignment(
        lease=LEASE,
        tenant_id="acme",
        root_run_id="run_0",
        input_text="post it",
        config=AgentConfig(
            model="claude-test",
            agent="support",
            system_prompt="Be brief.",
            system_blocks=(SystemBlock("Be brief.", "ephemeral"),),
            tool_allowlist=("post",),
            limits=Limits(max_steps=4, wall_clock_seconds=2.5, backoff_initial_seconds=0.25),
        ),
        history=(Part(-1, Role.USER, Text("earlier"), final=True), *PARTS),
        prior_part_count=1,
        last_seq=12,
        traceparent="00-abc-def-01",
        origin=Origin(
            "slack", "C42", "user", "U7", ReplyTarget("ch_1", "slack", "C42", "1.2", "3")
        ),
        has_documents=True,
        summary_part=Part(9, Role.ASSISTANT, summary, final=True),
        earlier_runs=(EarlierRun("run_a", 1),),
        last_turn_tokens=1300,
        last_turn_own=True,
        ended_children=(
            EndedChild("toolu_a", "run_c1", "completed", "the answer"),
            EndedChild("toolu_b", "run_c2", "failed", error=RunError("max_steps_exceeded", "x")),
        ),
    )
    response = assignment_to_proto(assignment, expires_at=datetime(2026, 12, 4, 19, tzinfo=UTC))
    assert response.claimed and response.lease.expires_at.seconds > 0
    back = assignment_from_proto(response)
    assert back == assignment
    assert back.summary == summary


def test_a_checkpoint_comes_back_as_sent() -> None:
    request = checkpoint_to_proto(LEASE, BATCH)
    assert (request.run_id, request.epoch) == (LEASE.run_id, LEASE.epoch)
    assert checkpoint_from_proto(request) == Batch(4, list(PARTS), list(EVENTS), [TURN])


@pytest.mark.parametrize("ending", ENDINGS, ids=lambda e: type(e).__name__)
def test_each_ending_comes_back_as_sent(ending: Ending) -> None:
    request = orchestrator_pb2.CompleteRunRequest()
    ending_to_proto(ending, request)
    assert ending_from_proto(request) == ending


def test_a_completion_comes_back_as_sent() -> None:
    done = Completion(
        ENDINGS[0],
        parts=PARTS,
        events=EVENTS,
        turns=(TURN, ModelTurn("claude-other", 1, 2, 3, 4)),
        stages={name: float(n) + 0.5 for n, name in enumerate(STAGES)},
        audit={"reason": "limit", "steps": 8.0, "tools": ["post"]},
        in_flight=BATCH,
    )
    request = completion_to_proto(LEASE, done)
    assert (request.run_id, request.epoch) == (LEASE.run_id, LEASE.epoch)
    back = completion_from_proto(request)
    assert back.ending == done.ending
    assert (tuple(back.parts), tuple(back.events), tuple(back.turns)) == (
        done.parts,
        done.events,
        done.turns,
    )
    assert back.stages == done.stages
    assert back.audit == done.audit
    assert back.in_flight == Batch(4, list(PARTS), list(EVENTS), [TURN])


@pytest.mark.parametrize(
    ("state", "result"),
    [
        (EffectState.BEGUN, None),
        (EffectState.IN_PROGRESS, None),
        (EffectState.DONE, {"posted": "p_1", "at": 3.0, "tags": ["a", "b"], "ok": True}),
    ],
    ids=str,
)
def test_an_effects_state_comes_back_as_found(
    state: EffectState, result: dict[str, object] | None
) -> None:
    assert effect_from_proto(effect_to_proto(state, result)) == (state, result)


def test_what_the_orchestrator_decides_is_never_taken_from_a_worker() -> None:
    superseded = Part(9, Role.ASSISTANT, Text("old"), final=True, superseded=True)
    priced = ModelTurn("claude-test", 1, 1, cost_micros=999)
    request = checkpoint_to_proto(LEASE, Batch(1, (superseded,), (), (priced,)))
    assert request.parts[0].part.superseded and request.turns[0].cost_micros == 999
    batch = checkpoint_from_proto(request)
    assert batch.parts == [Part(9, Role.ASSISTANT, Text("old"), final=True)]
    assert batch.turns == [ModelTurn("claude-test", 1, 1)]


def test_a_caller_mistake_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="batch must not be negative"):
        checkpoint_from_proto(checkpoint_to_proto(LEASE, Batch(-1)))
    with pytest.raises(InvalidArgument, match="ephemeral"):
        checkpoint_from_proto(checkpoint_to_proto(LEASE, Batch(1, (), (text_delta(3, "x", 1),))))
    with pytest.raises(InvalidArgument, match="status must be"):
        ending_from_proto(orchestrator_pb2.CompleteRunRequest(status=common_pb2.RUN_STATUS_QUEUED))
    other = completion_to_proto(Lease("run_1", 6), Completion(ENDINGS[0], in_flight=BATCH))
    request = completion_to_proto(LEASE, Completion(ENDINGS[0]))
    request.in_flight.CopyFrom(other.in_flight)
    with pytest.raises(InvalidArgument, match="same run and lease epoch"):
        completion_from_proto(request)
    unnumbered = completion_to_proto(LEASE, Completion(ENDINGS[0], in_flight=Batch(0)))
    with pytest.raises(InvalidArgument, match="batch number"):
        completion_from_proto(unnumbered)


def test_every_write_has_its_field_on_both_messages_and_a_handler_on_the_orchestrator() -> None:
    kinds = {f.name for f in orchestrator_pb2.WorkRequest.DESCRIPTOR.oneofs_by_name["kind"].fields}
    for kind, field in WRITE_FIELDS.items():
        message = write_request(5, kind())
        assert (message.id, message.WhichOneof("kind")) == (5, field)
        assert field in kinds
    assert len(WRITE_FIELDS) == 16  # start_child: run trees
    assert WRITE_FIELDS.keys() >= OUTCOMES
    assert {WRITE_FIELDS[kind] for kind in OUTCOMES} == {
        "complete",
        "park",
        "schedule_retry",
        "release",
    }
    # The model rate limits' two writes, answered with or without limits kept.
    limited = {**ExecutionServicer()._work_writes(), **model_limit_writes(ModelLimits())}
    assert limited.keys() == WRITE_FIELDS.keys()
    assert model_limit_writes(None).keys() == model_limit_writes(ModelLimits()).keys()
    assert ExecutionServicer()._work_writes().keys() == WRITE_FIELDS.keys() - {
        orchestrator_pb2.ReserveModelRequest,
        orchestrator_pb2.SettleModelRequest,
    }


def test_a_render_job_and_its_answer_come_back_as_sent() -> None:
    job = RenderJob(
        render_id=9,
        tenant_id="acme",
        config=AgentConfig(
            model="claude-test",
            agent="support",
            system_prompt="Be brief.",
            system_blocks=(SystemBlock("Be brief.", "ephemeral"),),
            tool_allowlist=("post",),
            limits=Limits(max_steps=4, max_tokens_per_turn=512),
        ),
        message="where is my parcel?",
        source="chat",
        channel="whatsapp",
        actor_type="user",
        actor_id="U7",
        documents=(FoundDocument("doc_1", "Parcels", "They start with TRK."),),
    )
    assert render_job_from_proto(render_job_to_proto(job)) == job
    # An integer stays an integer: the request travels as JSON text, not a Struct.
    request = {"model": "claude-test", "max_tokens": 512, "messages": [{"role": "user"}]}
    rendered = Rendered(9, request, 1234, 3702)
    back = rendered_from_proto(rendered_to_proto(rendered))
    assert back == rendered and isinstance(back.request["max_tokens"], int)
    refused = Rendered(9, {}, error_code="live_fact_failed", error_message="the clock stopped")
    assert rendered_from_proto(rendered_to_proto(refused)) == refused


def test_a_slot_is_given_back_by_an_outcome_or_a_delegate_call_answered_parked() -> None:
    """Both ends of the Work stream count a slot freed by `ends_lease`, and only by it."""
    start = orchestrator_pb2.StartChildRequest(run_id="r", epoch=1, tool_call_id="toolu_1")
    release = orchestrator_pb2.ReleaseRunRequest(run_id="r", epoch=1)
    checkpoint = orchestrator_pb2.CheckpointRequest(run_id="r", epoch=1)
    assert ends_lease(release, orchestrator_pb2.ReleaseRunResponse())
    assert ends_lease(start, orchestrator_pb2.StartChildResponse(parked=True))
    assert not ends_lease(start, orchestrator_pb2.StartChildResponse(created=True))
    assert not ends_lease(checkpoint, orchestrator_pb2.CheckpointResponse())
