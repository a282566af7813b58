"""Protobuf at the edges: domain types and stored rows to and from the wire, for the servicers and
the worker's orchestrator client (nothing between them handles protobuf)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

from tether import formats
from tether.domain import (
    ApprovalMarker,
    Attempt,
    ConnectionMarker,
    Content,
    Document,
    Event,
    EventType,
    Part,
    PricedTurn,
    QuestionMarker,
    Role,
    Run,
    RunError,
    Summary,
    Text,
    Thinking,
    TimerMarker,
    ToolCall,
    ToolResult,
)
from tether.errors import InvalidArgument, StoredFormatTooNew
from tether.states import RunStatus
from tether.v1 import common_pb2, events_pb2

_STATUS_TO_PROTO: dict[RunStatus, common_pb2.RunStatus.ValueType] = {
    s: getattr(common_pb2, "RUN_STATUS_" + s.name) for s in RunStatus
}
_STATUS_FROM_PROTO: dict[int, RunStatus] = {v: k for k, v in _STATUS_TO_PROTO.items()}


def status_to_proto(status: str) -> common_pb2.RunStatus.ValueType:
    """The proto enum value of a stored status."""
    return _STATUS_TO_PROTO[RunStatus(status)]


def status_from_proto(value: int) -> RunStatus | None:
    """The status of a proto enum value, None for UNSPECIFIED or unknown."""
    return _STATUS_FROM_PROTO.get(value)


def timestamp(value: datetime | None) -> Timestamp | None:
    """A Timestamp, or None for a missing time."""
    if value is None:
        return None
    ts = Timestamp()
    ts.FromDatetime(value)
    return ts


def run_to_proto(row: Run) -> common_pb2.Run:
    """A Run message from a run as read (its JSON columns in the row's stored format)."""
    what = f"run {row.run_id}"
    formats.check(row.format, what)
    try:
        error = (
            json_format.ParseDict(dict(row.error), common_pb2.ErrorInfo()) if row.error else None
        )
        usage = json_format.ParseDict(dict(row.usage or {}), common_pb2.Usage())
    except json_format.ParseError as exc:
        raise StoredFormatTooNew(f"{what} cannot be read by this release: {exc}") from exc
    return common_pb2.Run(
        run_id=row.run_id,
        tenant_id=row.tenant_id,
        session_id=row.session_id,
        conversation_id=row.conversation_id,
        channel=row.channel,
        input_text=row.input_text,
        status=status_to_proto(row.status),
        attempt=row.attempt,
        max_attempts=row.max_attempts,
        parent_run_id=row.parent_run_id or "",
        root_run_id=row.root_run_id,
        result_text=row.result_text or "",
        task_outcome=row.task_outcome or "",
        warnings=list(row.warnings or ()),
        error=error,
        usage=usage,
        next_attempt_at=timestamp(row.next_attempt_at),
        next_wake_at=timestamp(row.next_wake_at),
        created_at=timestamp(row.created_at),
        updated_at=timestamp(row.updated_at),
        finished_at=timestamp(row.finished_at),
        last_seq=row.last_seq,
        owner_principal_id=row.owner_principal_id or "",
        visibility=row.visibility,
        tree_parent_run_id=row.tree_parent_run_id or "",
        tree_root_run_id=row.tree_root_run_id or row.run_id,
        tree_depth=row.tree_depth,
        tree_call_id=row.tree_call_id or "",
    )


def attempt_to_proto(row: Attempt) -> common_pb2.Attempt:
    """An Attempt message from an attempt as read."""
    try:
        error = (
            json_format.ParseDict(dict(row.error), common_pb2.ErrorInfo()) if row.error else None
        )
    except json_format.ParseError as exc:
        what = f"attempt {row.lease_epoch} of run {row.run_id}"
        raise StoredFormatTooNew(f"{what} cannot be read by this release: {exc}") from exc
    return common_pb2.Attempt(
        attempt=row.attempt,
        lease_epoch=row.lease_epoch,
        worker_id=row.worker_id,
        started_at=timestamp(row.started_at),
        ended_at=timestamp(row.ended_at),
        outcome=row.outcome or "",
        error=error,
        # Stored as "<stage>_ms"; the field says the unit once.
        stage_ms={str(k).removesuffix("_ms"): float(v) for k, v in (row.stages or {}).items()},
    )


def turn_to_proto(row: PricedTurn) -> common_pb2.ModelTurn:
    """A ModelTurn message from a priced turn as read, with the attempt it belongs to."""
    return common_pb2.ModelTurn(
        usage=common_pb2.Usage(
            model=row.model,
            input_tokens=row.input_tokens,
            output_tokens=row.output_tokens,
            cache_creation_input_tokens=row.cache_creation_input_tokens,
            cache_read_input_tokens=row.cache_read_input_tokens,
            cost_micros=row.cost_micros,
        ),
        created_at=timestamp(row.created_at),
        attempt=row.attempt or 0,
    )


def error_to_proto(error: RunError) -> common_pb2.ErrorInfo:
    """An ErrorInfo from a run error."""
    return common_pb2.ErrorInfo(
        code=error.code,
        message=error.message,
        retryable=error.retryable,
        provider_status=error.provider_status,
    )


def error_from_proto(info: common_pb2.ErrorInfo) -> RunError:
    """The run error an ErrorInfo carries ("error" when it names no code)."""
    return RunError(info.code or "error", info.message, info.retryable, info.provider_status)


def event_to_proto(
    run_id: str,
    seq: int,
    type_: str,
    payload: Mapping[str, Any],
    created_at: datetime | None,
    *,
    format: int = formats.CURRENT,
) -> events_pb2.RunEvent:
    """A RunEvent from its stored or live form (the payload is the union member's JSON, in
    stored format `format`). A field this release does not know is refused, never dropped."""
    what = f"event {seq} of run {run_id}"
    try:
        kind = EventType(type_)
    except ValueError:
        raise StoredFormatTooNew(
            f"{what} has a type this release does not know: {type_!r}"
        ) from None
    event = events_pb2.RunEvent(
        run_id=run_id, seq=seq, type=type_, created_at=timestamp(created_at)
    )
    data = formats.read_event_payload(kind, payload, format, what)
    member = getattr(event, kind.field)
    member.SetInParent()  # an event with no fields still names its kind
    try:
        json_format.ParseDict(data, member)
    except json_format.ParseError as exc:
        raise StoredFormatTooNew(f"{what} cannot be read by this release: {exc}") from exc
    return event


def event_to_wire(event: Event) -> events_pb2.RunEvent:
    """A domain event as the RunEvent its sender puts on the wire (no run, seq or time yet).

    Built field by field from the payload's JSON: json_format.ParseDict took 15 to 25 us an
    event, more than the rest of a tool turn's bookkeeping; this takes 1 to 3 (a unit test holds
    the two equal for every event the domain builds)."""
    message = events_pb2.RunEvent(type=event.type)
    member = getattr(message, event.type.field)
    member.SetInParent()  # an event with no fields still names its kind
    _fill(member, event.payload)
    return message


class _Set(enum.Enum):
    """How `_fill` sets a field from its JSON."""

    SCALAR = enum.auto()
    REPEATED = enum.auto()  # of scalars: no event carries a list of messages
    STRUCT = enum.auto()
    TIMESTAMP = enum.auto()
    MESSAGE = enum.auto()


_FIELDS: dict[type[Message], dict[str, tuple[str, _Set]]] = {}


def _fill(message: Message, data: Mapping[str, Any]) -> None:
    """Set `message`'s fields from their protobuf JSON (camelCase) in `data`; KeyError on a
    field the message lacks."""
    fields = _FIELDS.get(type(message)) or _json_fields(type(message))
    for key, value in data.items():
        name, how = fields[key]
        if how is _Set.SCALAR:
            setattr(message, name, value)
        elif how is _Set.REPEATED:
            getattr(message, name).extend(value)
        else:
            member = getattr(message, name)
            member.SetInParent()  # present though empty: a call's empty input, an empty text
            if how is _Set.STRUCT:
                member.update(value)
            elif how is _Set.TIMESTAMP:
                member.FromJsonString(value)
            else:
                _fill(member, value)


def _json_fields(cls: type[Message]) -> dict[str, tuple[str, _Set]]:
    """A message type's fields by JSON name: (attribute, how it is set)."""
    special = {"google.protobuf.Struct": _Set.STRUCT, "google.protobuf.Timestamp": _Set.TIMESTAMP}
    fields: dict[str, tuple[str, _Set]] = {}
    for field in cls.DESCRIPTOR.fields:
        if field.message_type is None:
            how = _Set.REPEATED if field.is_repeated else _Set.SCALAR
        else:
            how = special.get(field.message_type.full_name, _Set.MESSAGE)
        fields[field.json_name] = (field.name, how)
    _FIELDS[cls] = fields
    return fields


def event_from_wire(message: events_pb2.RunEvent) -> Event:
    """The domain event a RunEvent carries; InvalidArgument when it carries none."""
    field = message.WhichOneof("payload")
    if field is None:
        raise InvalidArgument("an event must carry its payload")
    payload: dict[str, Any] = json_format.MessageToDict(getattr(message, field))
    return Event(_BY_FIELD[field], payload)


_BY_FIELD = {t.field: t for t in EventType}


def part_to_proto(part: Part) -> common_pb2.Part:
    """A Part message from a domain part."""
    message = common_pb2.Part(
        index=part.index, role=str(part.role), final=part.final, superseded=part.superseded
    )
    content = part.content
    if isinstance(content, Text):
        message.text.text = content.text
        message.text.SetInParent()
    elif isinstance(content, Thinking):
        message.thinking.SetInParent()
        message.thinking.thinking = content.thinking
        message.thinking.signature = content.signature
    elif isinstance(content, ToolCall):
        call = message.tool_call
        call.tool_call_id = content.tool_call_id
        call.name = content.name
        call.input.SetInParent()  # a call always has an input, if only an empty one
        call.input.update(dict(content.input))
    elif isinstance(content, ToolResult):
        message.tool_result.CopyFrom(
            common_pb2.ToolResultPart(
                tool_call_id=content.tool_call_id,
                content=content.content,
                is_error=content.is_error,
                output_ref=content.output_ref,
                truncated=content.truncated,
            )
        )
    elif isinstance(content, QuestionMarker):
        message.question.interaction_id = content.interaction_id
    elif isinstance(content, ApprovalMarker):
        message.approval.interaction_id = content.interaction_id
        message.approval.tool_name = content.tool_name
    elif isinstance(content, TimerMarker):
        message.timer.tool_call_id = content.tool_call_id
        message.timer.due_at.FromJsonString(content.due_at)
    elif isinstance(content, Summary):
        message.summary.CopyFrom(
            common_pb2.SummaryPart(
                text=content.text,
                from_run_id=content.from_run_id,
                through_run_id=content.through_run_id,
                runs=content.runs,
                parts=content.parts,
                tokens_before=content.tokens_before,
                tokens_after=content.tokens_after,
            )
        )
    else:
        message.connection.interaction_id = content.interaction_id
        message.connection.provider = content.provider
    return message


def part_from_proto(message: common_pb2.Part) -> Part:
    """The domain part a Part message carries; InvalidArgument when it holds no content. A
    worker never marks a part superseded (the orchestrator alone does), so the flag is left."""
    kind = message.WhichOneof("kind")
    content: Content
    if kind == "text":
        content = Text(message.text.text)
    elif kind == "thinking":
        content = Thinking(message.thinking.thinking, message.thinking.signature)
    elif kind == "tool_call":
        call = message.tool_call
        content = ToolCall(call.tool_call_id, call.name, json_format.MessageToDict(call.input))
    elif kind == "tool_result":
        result = message.tool_result
        content = ToolResult(
            result.tool_call_id,
            result.content,
            result.is_error,
            result.output_ref,
            result.truncated,
        )
    elif kind == "question":
        content = QuestionMarker(message.question.interaction_id)
    elif kind == "approval":
        content = ApprovalMarker(message.approval.interaction_id, message.approval.tool_name)
    elif kind == "connection":
        content = ConnectionMarker(message.connection.interaction_id, message.connection.provider)
    elif kind == "timer":
        content = TimerMarker(message.timer.tool_call_id, message.timer.due_at.ToJsonString())
    elif kind == "summary":
        summary = message.summary
        content = Summary(
            summary.text,
            summary.from_run_id,
            summary.through_run_id,
            summary.runs,
            summary.parts,
            summary.tokens_before,
            summary.tokens_after,
        )
    else:
        raise InvalidArgument("a part must hold content")
    return Part(
        message.index, message.role or Role.ASSISTANT, content, message.final, message.superseded
    )


_DISPOSITION_NAMES: dict[int, str] = {
    common_pb2.DISPOSITION_CREATED: "created",
    common_pb2.DISPOSITION_ATTACHED: "attached",
    common_pb2.DISPOSITION_REPLAYED: "replayed",
    common_pb2.DISPOSITION_RETRIED: "retried",
}


def disposition_name(value: int) -> str:
    """The lower-case name of a Disposition."""
    return _DISPOSITION_NAMES.get(value, "unspecified")


def document_to_proto(row: Document) -> common_pb2.Document:
    """A Document message from a document as listed (its text left out)."""
    return common_pb2.Document(
        document_id=row.document_id,
        title=row.title,
        chars=row.chars,
        created_by=row.created_by,
        created_at=timestamp(row.created_at),
    )
