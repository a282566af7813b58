"""Row <-> protobuf conversions shared by the services that return runs, parts and events."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from google.protobuf import json_format
from google.protobuf.timestamp_pb2 import Timestamp

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


def usage_from_dict(data: Mapping[str, Any] | None) -> common_pb2.Usage:
    """Usage from its stored JSON form."""
    return json_format.ParseDict(dict(data or {}), common_pb2.Usage(), ignore_unknown_fields=True)


def run_to_proto(row: Any) -> common_pb2.Run:
    """A Run message from a `runs` row."""
    error = row.error
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
        error=json_format.ParseDict(error, common_pb2.ErrorInfo()) if error else None,
        usage=usage_from_dict(row.usage),
        next_attempt_at=timestamp(row.next_attempt_at),
        created_at=timestamp(row.created_at),
        updated_at=timestamp(row.updated_at),
        finished_at=timestamp(row.finished_at),
        last_seq=row.last_seq,
        owner_principal_id=row.owner_principal_id or "",
        visibility=row.visibility,
    )


def event_to_proto(
    run_id: str, seq: int, type_: str, payload: Mapping[str, Any], created_at: datetime | None
) -> events_pb2.RunEvent:
    """A RunEvent from its stored form (the payload is the oneof member's JSON)."""
    event = events_pb2.RunEvent(
        run_id=run_id, seq=seq, type=type_, created_at=timestamp(created_at)
    )
    field = EVENT_FIELDS[type_]
    json_format.ParseDict(dict(payload), getattr(event, field), ignore_unknown_fields=True)
    return event


def event_payload(event: events_pb2.RunEvent) -> tuple[str, dict[str, Any]]:
    """The stable type name and JSON payload of an event, for storage."""
    field = event.WhichOneof("payload")
    if field is None:
        raise ValueError("event has no payload")
    return FIELD_TYPES[field], json_format.MessageToDict(getattr(event, field))


# Stable transport names of the event union's members.
EVENT_FIELDS: dict[str, str] = {
    "run.queued": "run_queued",
    "run.started": "run_started",
    "run.checkpointed": "run_checkpointed",
    "run.completed": "run_completed",
    "run.failed": "run_failed",
    "run.cancelled": "run_cancelled",
    "run.retry-pending": "run_retry_pending",
    "part.added": "part_added",
    "part.updated": "part_updated",
    "part.superseded": "part_superseded",
    "tool.started": "tool_started",
    "tool.completed": "tool_completed",
    "tool.failed": "tool_failed",
    "question.requested": "question_requested",
    "question.answered": "question_answered",
    "approval.requested": "approval_requested",
    "approval.decided": "approval_decided",
    "connection.requested": "connection_requested",
    "connection.completed": "connection_completed",
    "usage.updated": "usage_updated",
    "context.compacted": "context_compacted",
    "text.delta": "text_delta",
    "keepalive": "keepalive",
}
FIELD_TYPES = {v: k for k, v in EVENT_FIELDS.items()}


def part_to_proto(row: Any) -> common_pb2.Part:
    """A Part message from a `run_parts` row (payload is the kind's JSON)."""
    part = common_pb2.Part(
        index=row.part_index,
        role=row.role,
        final=row.final,
        superseded=row.superseded_at is not None,
    )
    json_format.ParseDict(dict(row.payload), getattr(part, row.kind), ignore_unknown_fields=True)
    return part


def part_payload(part: common_pb2.Part) -> tuple[str, dict[str, Any]]:
    """The kind and JSON payload of a part, for storage."""
    kind = part.WhichOneof("kind")
    if kind is None:
        raise ValueError("part has no content")
    return kind, json_format.MessageToDict(getattr(part, kind))


_DISPOSITION_NAMES: dict[int, str] = {
    common_pb2.DISPOSITION_CREATED: "created",
    common_pb2.DISPOSITION_ATTACHED: "attached",
    common_pb2.DISPOSITION_REPLAYED: "replayed",
    common_pb2.DISPOSITION_RETRIED: "retried",
}


def disposition_name(value: int) -> str:
    """The lower-case name of a Disposition."""
    return _DISPOSITION_NAMES.get(value, "unspecified")


def camel(name: str) -> str:
    """A snake_case name as protobuf's JSON mapping spells it (lowerCamelCase)."""
    head, *rest = name.split("_")
    return head + "".join(word.capitalize() for word in rest)


def camel_keys(data: dict[str, Any]) -> dict[str, Any]:
    """A dict with its keys renamed as `camel` spells them (values untouched)."""
    return {camel(key): value for key, value in data.items()}
