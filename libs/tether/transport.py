"""The transport event's meaning, shared by every channel that carries it (gRPC, SSE, the CLI).

A durable event (seq > 0) is the same everywhere: its stable type name, its seq and its payload,
the protobuf JSON of the union member (camelCase, exactly as stored and as published on Redis).
Ephemeral events (`text.delta`, `keepalive`) carry seq 0.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format

from tether.convert import status_from_proto, status_to_proto
from tether.domain import TERMINAL_EVENTS, EventType
from tether.states import TRANSITIONS
from tether.v1 import common_pb2, events_pb2

# A stream ends after delivering one of these.
TERMINAL_TYPES = TERMINAL_EVENTS

# Status a run has right after an event of this type was appended: the target of the
# transitions that append it (each event type moves a run to one status; tether.states).
STATUS_AFTER: dict[str, common_pb2.RunStatus.ValueType] = {
    t.event_type: status_to_proto(t.target) for t in TRANSITIONS.values()
}

# Trailing-metadata key naming the last durable seq a stream delivered before it was ended
# (slow consumer, gateway shutdown); the client resumes with after_seq set to it.
RESUME_SEQ_KEY = "tether-resume-after-seq"
# The same for a conversation stream: the cursor to resume from.
RESUME_CURSOR_KEY = "tether-resume-cursor"


def status_name(value: int) -> str:
    """A RunStatus spelled as in the state machine ("retry-pending"), "unspecified" for 0."""
    status = status_from_proto(value)
    return status.value if status else "unspecified"


def event_payload_json(event: events_pb2.RunEvent) -> dict[str, Any]:
    """The payload of an event: the protobuf JSON of its union member."""
    field = event.WhichOneof("payload")
    if field is None:
        return {}
    payload: dict[str, Any] = json_format.MessageToDict(getattr(event, field))
    if field == EventType.KEEPALIVE.field:
        payload["status"] = status_name(event.keepalive.status)
    return payload


def event_to_json(event: events_pb2.RunEvent) -> dict[str, Any]:
    """An event as one JSON object: run_id, seq (0 for ephemeral), type, created_at, payload."""
    data: dict[str, Any] = {"run_id": event.run_id, "seq": event.seq, "type": event.type}
    if event.HasField("created_at"):
        data["created_at"] = event.created_at.ToJsonString()
    data["payload"] = event_payload_json(event)
    return data


def part_to_json(part: common_pb2.Part) -> dict[str, Any]:
    """A part in the shape part events carry it (protobuf JSON)."""
    data: dict[str, Any] = json_format.MessageToDict(part)
    return data


def run_to_json(run: common_pb2.Run) -> dict[str, Any]:
    """A run as stable JSON: snake_case names, status spelled as in the state machine."""
    data: dict[str, Any] = json_format.MessageToDict(run, preserving_proto_field_name=True)
    data["status"] = status_name(run.status)
    return data


def snapshot_to_json(run: common_pb2.Run, parts: list[common_pb2.Part]) -> dict[str, Any]:
    """A stream's first message: the run and its persisted parts."""
    return {"run": run_to_json(run), "parts": [part_to_json(p) for p in parts]}


def apply_part_event(parts: dict[int, common_pb2.Part], event: events_pb2.RunEvent) -> bool:
    """Apply part.added / part.updated / part.superseded to a transcript keyed by part index
    (idempotent: the event carries the whole part, or drops it). Returns whether the event was
    a part event."""
    kind = event.WhichOneof("payload")
    if kind == "part_added":
        part = event.part_added.part
    elif kind == "part_updated":
        part = event.part_updated.part
    elif kind == "part_superseded":
        parts.pop(event.part_superseded.part_index, None)
        return True
    else:
        return False
    copy = common_pb2.Part()
    copy.CopyFrom(part)
    parts[part.index] = copy
    return True
