"""The Work stream's wire pairs, both halves of each in one place: the sender encodes with
`*_to_proto`, the receiver decodes with `*_from_proto`, and a round trip gives back what was
sent. A checkpoint and a completion go from the worker to the orchestrator; an assignment (a
pushed lease) and the state of a side effect's record come back. Which field of a WorkRequest
(and of its WorkAck) carries a write is read off the write's type, so neither end names the
stream's fields.

What the orchestrator's decoders refuse is a caller's mistake (InvalidArgument): a negative
batch number, an ephemeral event, an in-flight checkpoint of another lease, an ending that is no
ending. What they override is the orchestrator's to decide, never a worker's: whether a part is
superseded, and a turn's price.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from datetime import datetime
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message

from tether.convert import (
    error_from_proto,
    error_to_proto,
    event_from_wire,
    event_to_wire,
    part_from_proto,
    part_to_proto,
    status_from_proto,
    status_to_proto,
    timestamp,
)
from tether.convert.configs import config_from_proto, config_to_proto
from tether.domain import (
    CANCELLED_BY_CALLER,
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
    Event,
    Failed,
    Lease,
    ModelTurn,
    Origin,
    Part,
    ReplyTarget,
)
from tether.errors import InvalidArgument
from tether.states import RunStatus
from tether.v1 import common_pb2, events_pb2, orchestrator_pb2


def _write_fields() -> dict[type[Message], str]:
    # A write's WorkRequest field and its WorkAck field share their name (orchestrator.proto).
    request = orchestrator_pb2.WorkRequest()
    answers = orchestrator_pb2.WorkAck.DESCRIPTOR.oneofs_by_name["result"].fields
    return {type(getattr(request, field.name)): field.name for field in answers}


WRITE_FIELDS = _write_fields()
"""Each write's request type, and the WorkRequest field (the WorkAck field) that carries it."""

OUTCOMES: frozenset[type[Message]] = frozenset(
    {
        orchestrator_pb2.CompleteRunRequest,
        orchestrator_pb2.ParkRunRequest,
        orchestrator_pb2.ScheduleRetryRequest,
        orchestrator_pb2.ReleaseRunRequest,
    }
)
"""The writes after which the run is out of the worker's hands (and its slot free)."""


def ends_lease(written: Message, answer: Message) -> bool:
    """Whether a write, as answered, took its run out of the worker's hands (its slot free):
    an outcome, or a delegate call that parked the run (StartChildResponse.parked). Both ends
    of the Work stream count a slot given back by this, and only this."""
    if type(written) in OUTCOMES:
        return True
    return isinstance(answer, orchestrator_pb2.StartChildResponse) and answer.parked


STAGES = tuple(f.name for f in orchestrator_pb2.StageDurations.DESCRIPTOR.fields)
"""An attempt's stage durations by name: every field of StageDurations."""
_STAGE_NAMES = frozenset(STAGES)


def write_request(request_id: int, write: Message) -> orchestrator_pb2.WorkRequest:
    """`write` as the WorkRequest numbered `request_id` that carries it."""
    message = orchestrator_pb2.WorkRequest(id=request_id)
    getattr(message, WRITE_FIELDS[type(write)]).CopyFrom(write)
    return message


# -- an assignment (a pushed lease) ------------------------------------------------------------


def config_message(config: AgentConfig) -> orchestrator_pb2.AgentConfig:
    """`config` as the wire carries it, built once per routing: the claims hand every run of a
    routing the same AgentConfig (building its message was about 2% of the orchestrator's CPU
    per run). Held with the config itself, so no other config is ever mistaken for it."""
    held = _CONFIG_MESSAGES.get(id(config))
    if held is None or held[0] is not config:
        if len(_CONFIG_MESSAGES) >= MAX_CONFIG_MESSAGES:
            _CONFIG_MESSAGES.clear()
        held = _CONFIG_MESSAGES[id(config)] = (config, config_to_proto(config))
    return held[1]


_CONFIG_MESSAGES: dict[int, tuple[AgentConfig, orchestrator_pb2.AgentConfig]] = {}
MAX_CONFIG_MESSAGES = 1024
"""How many routings' config messages are kept (then all are dropped and built again)."""


def assignment_to_proto(
    assignment: Assignment, *, expires_at: datetime | None, run: common_pb2.Run | None = None
) -> orchestrator_pb2.ClaimRunResponse:
    """A lease with the attempt's inputs, as the worker receives it. `run` is the run message
    to send (the orchestrator sends the whole run); without one, the run's facts the worker
    reads."""
    lease, origin = assignment.lease, assignment.origin
    if run is None:
        run = common_pb2.Run(
            run_id=lease.run_id,
            tenant_id=assignment.tenant_id,
            root_run_id=assignment.root_run_id,
            input_text=assignment.input_text,
            channel=origin.channel,
        )
    summary = assignment.summary_part
    return orchestrator_pb2.ClaimRunResponse(
        claimed=True,
        lease=orchestrator_pb2.Lease(
            run_id=lease.run_id,
            epoch=lease.epoch,
            attempt=lease.attempt,
            expires_at=timestamp(expires_at),
        ),
        run=run,
        config=config_message(assignment.config),
        history=[part_to_proto(p) for p in assignment.history],
        prior_part_count=assignment.prior_part_count,
        last_seq=assignment.last_seq,
        traceparent=assignment.traceparent,
        context=orchestrator_pb2.AttemptContext(
            source=origin.source,
            actor_type=origin.actor_type,
            actor_id=origin.actor_id,
            has_documents=assignment.has_documents,
            summary=None if summary is None else part_to_proto(summary),
            earlier_runs=[
                orchestrator_pb2.EarlierRunSpan(run_id=e.run_id, parts=e.parts)
                for e in assignment.earlier_runs
            ],
            last_turn_tokens=assignment.last_turn_tokens,
            ended_children=[ended_child_to_proto(c) for c in assignment.ended_children],
            last_turn_own=assignment.last_turn_own,
            reply=None if origin.reply is None else reply_to_proto(origin.reply),
        ),
    )


def assignment_from_proto(response: orchestrator_pb2.ClaimRunResponse) -> Assignment:
    """The run a pushed lease (a ClaimRunResponse) hands the worker."""
    run, context, lease = response.run, response.context, response.lease
    return Assignment(
        lease=Lease(lease.run_id, lease.epoch, lease.attempt),
        tenant_id=run.tenant_id,
        root_run_id=run.root_run_id or lease.run_id,
        input_text=run.input_text,
        config=config_from_proto(response.config),
        history=tuple(part_from_proto(p) for p in response.history),
        prior_part_count=response.prior_part_count,
        last_seq=response.last_seq,
        traceparent=response.traceparent,
        origin=Origin(
            context.source,
            run.channel,
            context.actor_type,
            context.actor_id,
            reply_from_proto(context.reply) if context.HasField("reply") else None,
        ),
        has_documents=context.has_documents,
        summary_part=part_from_proto(context.summary) if context.HasField("summary") else None,
        earlier_runs=tuple(EarlierRun(e.run_id, e.parts) for e in context.earlier_runs),
        last_turn_tokens=context.last_turn_tokens,
        last_turn_own=context.last_turn_own,
        ended_children=tuple(ended_child_from_proto(c) for c in context.ended_children),
    )


def ended_child_to_proto(child: EndedChild) -> orchestrator_pb2.EndedChild:
    """A child that has ended, on the wire."""
    return orchestrator_pb2.EndedChild(
        tool_call_id=child.tool_call_id,
        child_run_id=child.run_id,
        status=status_to_proto(child.status),
        result_text=child.result_text,
        error=None if child.error is None else error_to_proto(child.error),
    )


def ended_child_from_proto(child: orchestrator_pb2.EndedChild) -> EndedChild:
    """A child that has ended, from the wire."""
    status = status_from_proto(child.status)
    return EndedChild(
        child.tool_call_id,
        child.child_run_id,
        status.value if status is not None else "",
        child.result_text,
        error_from_proto(child.error) if child.HasField("error") else None,
    )


def reply_to_proto(reply: ReplyTarget) -> common_pb2.ReplyTarget:
    """Where an answer goes, on the wire."""
    return common_pb2.ReplyTarget(
        channel_id=reply.channel_id,
        kind=reply.kind,
        address=reply.address,
        thread=reply.thread,
        reply_to=reply.reply_to,
    )


def reply_from_proto(reply: common_pb2.ReplyTarget) -> ReplyTarget:
    """Where an answer goes, from the wire."""
    return ReplyTarget(reply.channel_id, reply.kind, reply.address, reply.thread, reply.reply_to)


# -- progress -----------------------------------------------------------------------------------


def turn_to_proto(turn: ModelTurn) -> common_pb2.Usage:
    """A model turn's usage."""
    return common_pb2.Usage(model=turn.model, cost_micros=turn.cost_micros, **turn.tokens())


def turns_from_proto(turns: Iterable[common_pb2.Usage]) -> list[ModelTurn]:
    """Model turns, unpriced: the orchestrator prices every turn at its run's own prices."""
    return [
        ModelTurn(
            t.model,
            t.input_tokens,
            t.output_tokens,
            t.cache_creation_input_tokens,
            t.cache_read_input_tokens,
        )
        for t in turns
    ]


def part_writes_from_proto(writes: Iterable[orchestrator_pb2.PartWrite]) -> list[Part]:
    """Parts as a worker wrote them. A worker never marks a part superseded: the orchestrator
    alone decides that."""
    return [replace(part_from_proto(w.part), superseded=False) for w in writes]


def events_from_proto(events: Iterable[events_pb2.RunEvent]) -> list[Event]:
    """Events a worker wrote, to be stored: an ephemeral one is refused (it is never stored)."""
    out = []
    for message in events:
        event = event_from_wire(message)
        if event.type.ephemeral:
            raise InvalidArgument(f"{event.type} is ephemeral and is never persisted")
        out.append(event)
    return out


def checkpoint_to_proto(lease: Lease, batch: Batch) -> orchestrator_pb2.CheckpointRequest:
    """A numbered batch of progress under `lease`."""
    return orchestrator_pb2.CheckpointRequest(
        run_id=lease.run_id,
        epoch=lease.epoch,
        parts=[orchestrator_pb2.PartWrite(part=part_to_proto(p)) for p in batch.parts],
        events=[event_to_wire(e) for e in batch.events],
        turns=[turn_to_proto(t) for t in batch.turns],
        batch=batch.number,
    )


def checkpoint_from_proto(request: orchestrator_pb2.CheckpointRequest) -> Batch:
    """The batch of a checkpoint (its lease is the request's run_id and epoch)."""
    if request.batch < 0:
        raise InvalidArgument("batch must not be negative")
    return Batch(
        request.batch,
        part_writes_from_proto(request.parts),
        events_from_proto(request.events),
        turns_from_proto(request.turns),
    )


# -- the ending of an attempt -------------------------------------------------------------------


def ending_to_proto(ending: Ending, request: orchestrator_pb2.CompleteRunRequest) -> None:
    """Write `ending` into the completion that carries it."""
    if isinstance(ending, Completed):
        request.status = common_pb2.RUN_STATUS_COMPLETED
        request.result_text = ending.result_text
        request.task_outcome = ending.task_outcome
        request.warnings.extend(ending.warnings)
    elif isinstance(ending, Failed):
        request.status = common_pb2.RUN_STATUS_FAILED
        request.error.CopyFrom(error_to_proto(ending.error))
    else:
        request.status = common_pb2.RUN_STATUS_CANCELLED
        request.error.CopyFrom(common_pb2.ErrorInfo(code="cancelled", message=ending.reason))


def ending_from_proto(request: orchestrator_pb2.CompleteRunRequest) -> Ending:
    """The ending a completion carries."""
    status = status_from_proto(request.status)
    if status is RunStatus.COMPLETED:
        return Completed(request.result_text, request.task_outcome, tuple(request.warnings))
    if status is RunStatus.FAILED:
        return Failed(error_from_proto(request.error))
    if status is RunStatus.CANCELLED:
        return Cancelled(request.error.message or CANCELLED_BY_CALLER)
    raise InvalidArgument("status must be COMPLETED, FAILED or CANCELLED")


def completion_to_proto(lease: Lease, done: Completion) -> orchestrator_pb2.CompleteRunRequest:
    """An attempt's completion under `lease`, with the progress it carries."""
    request = orchestrator_pb2.CompleteRunRequest(
        run_id=lease.run_id,
        epoch=lease.epoch,
        parts=[orchestrator_pb2.PartWrite(part=part_to_proto(p)) for p in done.parts],
        turns=[turn_to_proto(t) for t in done.turns],
        events=[event_to_wire(e) for e in done.events],
        stages=orchestrator_pb2.StageDurations(
            **{k: v for k, v in done.stages.items() if k in _STAGE_NAMES}
        ),
    )
    ending_to_proto(done.ending, request)
    if done.audit:
        json_format.ParseDict(done.audit, request.audit)
    if done.in_flight is not None:
        request.in_flight.CopyFrom(checkpoint_to_proto(lease, done.in_flight))
    return request


def completion_from_proto(request: orchestrator_pb2.CompleteRunRequest) -> Completion:
    """The completion a CompleteRunRequest carries (every stage named, 0 when unset)."""
    ending = ending_from_proto(request)
    in_flight = None
    if request.HasField("in_flight"):
        flight = request.in_flight
        if flight.run_id != request.run_id or flight.epoch != request.epoch:
            raise InvalidArgument("in_flight must be a checkpoint of the same run and lease epoch")
        if flight.batch <= 0:
            raise InvalidArgument("in_flight needs its batch number (> 0)")
        in_flight = checkpoint_from_proto(flight)
    return Completion(
        ending,
        parts=part_writes_from_proto(request.parts),
        events=events_from_proto(request.events),
        turns=turns_from_proto(request.turns),
        stages={name: getattr(request.stages, name) for name in STAGES},
        audit=json_format.MessageToDict(request.audit),
        in_flight=in_flight,
    )


# -- a side effect's record ---------------------------------------------------------------------

_EFFECT_STATES = {
    EffectState.BEGUN: orchestrator_pb2.EFFECT_STATE_BEGUN,
    EffectState.IN_PROGRESS: orchestrator_pb2.EFFECT_STATE_IN_PROGRESS,
    EffectState.DONE: orchestrator_pb2.EFFECT_STATE_DONE,
}
_EFFECT_STATES_BACK = {wire: state for state, wire in _EFFECT_STATES.items()}


def effect_to_proto(
    state: EffectState, result: dict[str, Any] | None
) -> orchestrator_pb2.BeginEffectResponse:
    """What opening a side effect's record found: its state, and its result when done."""
    response = orchestrator_pb2.BeginEffectResponse(state=_EFFECT_STATES[state])
    if result is not None:
        json_format.ParseDict(result, response.result)
    return response


def effect_from_proto(
    response: orchestrator_pb2.BeginEffectResponse,
) -> tuple[EffectState, dict[str, Any] | None]:
    """The state of a side effect's record, and its stored result when it is done."""
    state = _EFFECT_STATES_BACK[response.state]
    result = json_format.MessageToDict(response.result) if state is EffectState.DONE else None
    return state, result
