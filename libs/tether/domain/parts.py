"""A run's transcript as typed parts, and their JSON form (stored in run_parts, carried by part
events: a Part message's protobuf JSON)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar


class Role(enum.StrEnum):
    """Who produced a part."""

    ASSISTANT = "assistant"
    USER = "user"
    TOOL = "tool"


class PartKind(enum.StrEnum):
    """What a part holds; the stored `run_parts.kind` and the Part union's member name."""

    TEXT = "text"
    THINKING = "thinking"
    TOOL_CALL = "tool_call"
    TOOL_RESULT = "tool_result"
    QUESTION = "question"
    APPROVAL = "approval"
    CONNECTION = "connection"
    SUMMARY = "summary"
    TIMER = "timer"


@dataclass(frozen=True, slots=True)
class Text:
    """Prose."""

    text: str = ""
    kind: ClassVar[PartKind] = PartKind.TEXT


@dataclass(frozen=True, slots=True)
class Thinking:
    """Extended thinking; sent back to the model only whole and signed."""

    thinking: str = ""
    signature: str = ""
    kind: ClassVar[PartKind] = PartKind.THINKING


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call the model made; its input is whole once the part is final."""

    tool_call_id: str
    name: str
    input: Mapping[str, Any] = field(default_factory=dict)
    kind: ClassVar[PartKind] = PartKind.TOOL_CALL

    def __post_init__(self) -> None:
        # Numbers as doubles, as protobuf's Struct carries them on every hop: the input hashes
        # to the same idempotency key whichever way it arrived (streamed, stored, approved).
        object.__setattr__(self, "input", json_doubles(self.input))


def json_doubles(value: Any) -> Any:
    """`value` (JSON data) with every number a float, as JSON's and Struct's model has it."""
    if isinstance(value, bool) or value is None or isinstance(value, str | float):
        return value
    if isinstance(value, int):
        return float(value)
    if isinstance(value, Mapping):
        return {str(k): json_doubles(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_doubles(v) for v in value]
    return value


@dataclass(frozen=True, slots=True)
class ToolResult:
    """A call's result; `output_ref` names the whole output when the inline copy was cut."""

    tool_call_id: str
    content: str = ""
    is_error: bool = False
    output_ref: str = ""
    truncated: bool = False
    kind: ClassVar[PartKind] = PartKind.TOOL_RESULT


@dataclass(frozen=True, slots=True)
class QuestionMarker:
    """The run asked a person; the answers resolve the interaction."""

    interaction_id: str
    kind: ClassVar[PartKind] = PartKind.QUESTION


@dataclass(frozen=True, slots=True)
class ApprovalMarker:
    """A gated call waits for a person's decision."""

    interaction_id: str
    tool_name: str = ""
    kind: ClassVar[PartKind] = PartKind.APPROVAL


@dataclass(frozen=True, slots=True)
class ConnectionMarker:
    """A call waits for a person to connect an account."""

    interaction_id: str
    provider: str = ""
    kind: ClassVar[PartKind] = PartKind.CONNECTION


@dataclass(frozen=True, slots=True)
class TimerMarker:
    """A `wait_until` call parked the run until `due_at` (RFC 3339, UTC): the resumed attempt
    answers the call once that time has passed, and parks again until it has."""

    tool_call_id: str
    due_at: str
    kind: ClassVar[PartKind] = PartKind.TIMER


@dataclass(frozen=True, slots=True)
class Summary:
    """A summary standing in for the session's earlier runs from `from_run_id` through
    `through_run_id` in the history the model sees (context compaction); those runs keep their
    parts. `runs` and `parts` count what it replaced; the tokens are the request's estimate
    before and after."""

    text: str
    from_run_id: str = ""
    through_run_id: str = ""
    runs: int = 0
    parts: int = 0
    tokens_before: int = 0
    tokens_after: int = 0
    kind: ClassVar[PartKind] = PartKind.SUMMARY


Content = (
    Text
    | Thinking
    | ToolCall
    | ToolResult
    | QuestionMarker
    | ApprovalMarker
    | ConnectionMarker
    | TimerMarker
    | Summary
)


@dataclass(frozen=True, slots=True)
class Part:
    """One typed piece of a run's transcript at its position `index`. `final` once complete (a
    streaming part is rewritten until then); `superseded` once a later attempt took its place
    (set by the orchestrator alone: kept for audit, never sent to the model, left out of every
    transcript read)."""

    index: int
    role: str
    content: Content
    final: bool = False
    superseded: bool = False

    @property
    def kind(self) -> PartKind:
        """What the part holds."""
        return self.content.kind


# -- the JSON form of parts (stored in run_parts, carried by part events) -------------------------


def camel(name: str) -> str:
    """A snake_case name as protobuf's JSON mapping spells it (lowerCamelCase)."""
    head, *rest = name.split("_")
    return head + "".join(word.capitalize() for word in rest)


def camel_keys(data: Mapping[str, Any]) -> dict[str, Any]:
    """A dict with its keys renamed as `camel` spells them (values untouched)."""
    return {camel(key): value for key, value in data.items()}


_CONTENT_TYPES: dict[PartKind, type[Any]] = {
    c.kind: c
    for c in (
        Text,
        Thinking,
        ToolCall,
        ToolResult,
        QuestionMarker,
        ApprovalMarker,
        ConnectionMarker,
        TimerMarker,
        Summary,
    )
}
# Each content type's fields and their JSON names, in declaration order.
_CONTENT_FIELDS: dict[type[Any], tuple[tuple[str, str], ...]] = {
    cls: tuple((f.name, camel(f.name)) for f in fields(cls)) for cls in _CONTENT_TYPES.values()
}


def content_json(content: Content) -> dict[str, Any]:
    """A part's content in its JSON form (its Part union member's protobuf JSON: camelCase,
    scalar defaults left out, an object such as a call's input always written)."""
    out: dict[str, Any] = {}
    for name, key in _CONTENT_FIELDS[type(content)]:
        value = getattr(content, name)
        if isinstance(value, Mapping):
            out[key] = dict(value)
        elif value:
            out[key] = value
    return out


def content_from_json(kind: str, data: Mapping[str, Any]) -> Content:
    """The content `content_json` wrote; ValueError on an unknown kind or field (a field this
    release does not know is refused, never dropped)."""
    try:
        cls = _CONTENT_TYPES[PartKind(kind)]
    except ValueError:
        raise ValueError(f"unknown part kind {kind!r}") from None
    known = _CONTENT_FIELDS[cls]
    names = {key: name for name, key in known}
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)} in a {kind} part")
    content: Content = cls(**{names[key]: value for key, value in data.items()})
    if isinstance(content, ToolCall) and not isinstance(content.input, Mapping):
        raise ValueError("a tool_call part's input must be an object")
    return content


def part_json(part: Part) -> dict[str, Any]:
    """A part in its JSON form (a Part message's protobuf JSON)."""
    data: dict[str, Any] = {
        "index": part.index,
        "role": str(part.role),
        camel(part.kind): content_json(part.content),
    }
    if part.final:
        data["final"] = True
    if part.superseded:
        data["superseded"] = True
    return data


def part_from_json(data: Mapping[str, Any]) -> Part:
    """The part `part_json` wrote; ValueError when it is not one."""
    kinds = [k for k in PartKind if camel(k) in data]
    if len(kinds) != 1:
        raise ValueError("a part holds exactly one kind of content")
    kind = kinds[0]
    unknown = set(data) - {"index", "role", "final", "superseded", camel(kind)}
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))} in a part")
    return Part(
        int(data.get("index", 0)),
        str(data.get("role") or Role.ASSISTANT),
        content_from_json(kind, data[camel(kind)]),
        bool(data.get("final", False)),
        bool(data.get("superseded", False)),
    )
