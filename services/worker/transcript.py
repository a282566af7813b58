"""The attempt's view of its run's transcript: parts, pending events and unpersisted turns.

Parts are typed protobuf messages (the worker's wire model; it owns no storage). A checkpoint
sends only what changed since the last one, so its cost follows the new parts, never the
history.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

from google.protobuf.struct_pb2 import Struct

from tether.v1 import common_pb2, events_pb2


def event(type_: str, **fields: object) -> events_pb2.RunEvent:
    """A durable event of the transport union; `fields` are the payload's (snake_case) fields,
    a dict standing for a nested message. Built directly: json_format.ParseDict cost more than
    the rest of a tool turn's bookkeeping together."""
    message = events_pb2.RunEvent(type=type_)
    payload = getattr(message, type_.replace(".", "_").replace("-", "_"))
    payload.SetInParent()  # an event with no fields still names its kind
    for name, value in fields.items():
        if isinstance(value, dict):
            getattr(payload, name).MergeFrom(type(getattr(payload, name))(**value))
        else:
            setattr(payload, name, value)
    return message


class Transcript:
    """Parts of the current run, and what the next checkpoint must carry."""

    def __init__(self, own_parts: Sequence[common_pb2.Part]) -> None:
        self.parts: list[common_pb2.Part] = [_copy(p) for p in own_parts]
        self._dirty: dict[int, common_pb2.Part] = {}
        self.events: list[events_pb2.RunEvent] = []
        self.turns: list[common_pb2.Usage] = []
        self.last_flush = time.monotonic()

    @property
    def next_index(self) -> int:
        """Index the next part gets."""
        return (self.parts[-1].index + 1) if self.parts else 0

    def add(self, part: common_pb2.Part) -> common_pb2.Part:
        """Append a new part (announced with part.added)."""
        part.index = self.next_index
        self.parts.append(part)
        self._dirty[part.index] = part
        self.events.append(self._part_event("part.added", part))
        return part

    def touch(self, part: common_pb2.Part, *, announce: bool) -> None:
        """Mark a part changed; `announce` adds a part.updated event carrying it whole."""
        self._dirty[part.index] = part
        if announce:
            self.events.append(self._part_event("part.updated", part))

    @staticmethod
    def _part_event(type_: str, part: common_pb2.Part) -> events_pb2.RunEvent:
        message = events_pb2.RunEvent(type=type_)
        target = message.part_added if type_ == "part.added" else message.part_updated
        target.part.CopyFrom(part)
        return message

    def take(
        self,
    ) -> tuple[list[common_pb2.Part], list[events_pb2.RunEvent], list[common_pb2.Usage]]:
        """What changed since the last checkpoint; resets the pending state."""
        parts = [_copy(p) for p in self._dirty.values()]
        events, turns = self.events, self.turns
        self._dirty, self.events, self.turns = {}, [], []
        self.last_flush = time.monotonic()
        return parts, events, turns

    @property
    def pending(self) -> bool:
        """Whether anything awaits a checkpoint."""
        return bool(self._dirty or self.events or self.turns)

    def dangling_tool_calls(self) -> list[common_pb2.Part]:
        """Whole tool calls of this run with no result yet. A call cut mid-stream (left
        unfinished, superseded by the orchestrator, or marked `cut` by earlier releases) is not
        one: it never runs and gets no result."""
        answered = {
            p.tool_result.tool_call_id for p in self.parts if p.WhichOneof("kind") == "tool_result"
        }
        return [
            p
            for p in self.parts
            if p.WhichOneof("kind") == "tool_call"
            and p.final
            and not p.superseded
            and not p.tool_call.cut
            and p.tool_call.tool_call_id not in answered
        ]

    def close_dangling(self, reason: str) -> None:
        """Close every open tool call with an interrupted error result."""
        for call in self.dangling_tool_calls():
            self.add(
                tool_result_part(
                    call.tool_call.tool_call_id, f"interrupted: {reason}", is_error=True
                )
            )
            self.events.append(
                event(
                    "tool.failed",
                    tool_call_id=call.tool_call.tool_call_id,
                    name=call.tool_call.name,
                    error={"code": "tool_interrupted", "message": reason},
                )
            )

    def final_text(self, since: int) -> str:
        """Assistant text of the parts from index `since` on."""
        return "".join(
            p.text.text
            for p in self.parts
            if p.index >= since and p.role == "assistant" and p.WhichOneof("kind") == "text"
        )


def _copy(part: common_pb2.Part) -> common_pb2.Part:
    out = common_pb2.Part()
    out.CopyFrom(part)
    return out


def tool_result_part(
    call_id: str, content: str, *, is_error: bool, output_ref: str = "", truncated: bool = False
) -> common_pb2.Part:
    """A final tool result part."""
    return common_pb2.Part(
        role="tool",
        final=True,
        tool_result=common_pb2.ToolResultPart(
            tool_call_id=call_id,
            content=content,
            is_error=is_error,
            output_ref=output_ref,
            truncated=truncated,
        ),
    )


def struct(data: dict[str, object]) -> Struct:
    """A Struct from JSON-compatible data."""
    out = Struct()
    out.update(json.loads(json.dumps(data)))
    return out
