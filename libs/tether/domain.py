"""The run's domain model: parts, events, errors and endings as frozen types, and the rules on
them that the orchestrator and the worker both apply (which tool calls dangle, what an attempt
that is over leaves superseded, how an interrupted call is closed).

Protobuf stops at the edges: the servicers and the worker's orchestrator client convert with
`tether.convert`. Storage stops at the repositories, which read and write these types through
`tether.formats` (the stored JSON, versioned). Everything in between speaks these types.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

# -- events -------------------------------------------------------------------------------------


class EventType(enum.StrEnum):
    """Every event of a run, by its stable transport name (the event union in events.proto)."""

    RUN_QUEUED = "run.queued"
    RUN_STARTED = "run.started"
    RUN_CHECKPOINTED = "run.checkpointed"
    RUN_COMPLETED = "run.completed"
    RUN_FAILED = "run.failed"
    RUN_CANCELLED = "run.cancelled"
    RUN_RETRY_PENDING = "run.retry-pending"
    PART_ADDED = "part.added"
    PART_UPDATED = "part.updated"
    PART_SUPERSEDED = "part.superseded"
    TOOL_STARTED = "tool.started"
    TOOL_COMPLETED = "tool.completed"
    TOOL_FAILED = "tool.failed"
    QUESTION_REQUESTED = "question.requested"
    QUESTION_ANSWERED = "question.answered"
    APPROVAL_REQUESTED = "approval.requested"
    APPROVAL_DECIDED = "approval.decided"
    CONNECTION_REQUESTED = "connection.requested"
    CONNECTION_COMPLETED = "connection.completed"
    USAGE_UPDATED = "usage.updated"
    CONTEXT_COMPACTED = "context.compacted"
    TEXT_DELTA = "text.delta"
    KEEPALIVE = "keepalive"

    @property
    def field(self) -> str:
        """Its member of the RunEvent union (`run.retry-pending` -> run_retry_pending)."""
        return self.value.replace(".", "_").replace("-", "_")

    @property
    def ephemeral(self) -> bool:
        """Never persisted and carried with seq 0: live token deltas and stream keepalives."""
        return self in _EPHEMERAL

    @property
    def terminal(self) -> bool:
        """The last event of a run: a stream ends after delivering it."""
        return self in TERMINAL_EVENTS


_EPHEMERAL = frozenset({EventType.TEXT_DELTA, EventType.KEEPALIVE})
TERMINAL_EVENTS = frozenset(
    {EventType.RUN_COMPLETED, EventType.RUN_FAILED, EventType.RUN_CANCELLED}
)


@dataclass(frozen=True, slots=True)
class Event:
    """A durable event to append: its type and payload, the stored JSON of its union member
    (protobuf's JSON mapping, camelCase). Build one with the constructors below."""

    type: EventType
    payload: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class StoredEvent:
    """An event appended to a run's log, with the seq it was given."""

    seq: int
    event: Event


# -- errors, usage and how an attempt ends ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunError:
    """Why a run, an attempt or a tool call failed: a stable code and words for a person."""

    code: str
    message: str = ""
    retryable: bool = False
    provider_status: int = 0

    def to_row(self) -> dict[str, Any]:
        """The stored form (`runs.error`, `attempts.error`)."""
        return {
            "code": self.code,
            "message": self.message,
            "retryable": self.retryable,
            "provider_status": self.provider_status,
        }

    def to_json(self) -> dict[str, Any]:
        """The form events carry (ErrorInfo's JSON): defaults left out, as protobuf writes it."""
        data: dict[str, Any] = {"code": self.code}
        if self.message:
            data["message"] = self.message
        if self.retryable:
            data["retryable"] = True
        if self.provider_status:
            data["providerStatus"] = self.provider_status
        return data

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> RunError:
        """From the stored form (either spelling of the provider status)."""
        return cls(
            str(row.get("code") or "error"),
            str(row.get("message") or ""),
            bool(row.get("retryable", False)),
            int(row.get("provider_status", row.get("providerStatus", 0)) or 0),
        )


TOKEN_FIELDS = (
    "input_tokens",
    "output_tokens",
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
)


@dataclass(frozen=True, slots=True)
class ModelTurn:
    """The usage of one model call, priced at its own model's rate (0 until priced)."""

    model: str
    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    cost_micros: int = 0

    def tokens(self) -> dict[str, int]:
        """The token counts by their stored names."""
        return {k: getattr(self, k) for k in TOKEN_FIELDS}


@dataclass(frozen=True, slots=True)
class Completed:
    """The runtime answered. `task_outcome` says whether the task is done ("resolved") or a
    limit stopped it first ("unresolved"): runtime completion is not business completion."""

    result_text: str = ""
    task_outcome: str = "resolved"
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Failed:
    """The run failed for good."""

    error: RunError


@dataclass(frozen=True, slots=True)
class Cancelled:
    """A caller's cancel ended the run."""

    reason: str = "cancelled by caller"


Ending = Completed | Failed | Cancelled

# -- parts --------------------------------------------------------------------------------------


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


Content = (
    Text | Thinking | ToolCall | ToolResult | QuestionMarker | ApprovalMarker | ConnectionMarker
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


# -- the rules on parts -------------------------------------------------------------------------

# Parts the model produces in a turn; any other part (a tool result, a pause marker) ends one.
_MODEL_OUTPUT = frozenset({PartKind.TEXT, PartKind.THINKING, PartKind.TOOL_CALL})


def is_whole_call(part: Part) -> bool:
    """A tool call whose input arrived whole: it may run, and it is answered by a result."""
    return isinstance(part.content, ToolCall) and part.final


def dangling_tool_calls(parts: Sequence[Part]) -> list[Part]:
    """Whole tool calls without a result: left open by a pause, a crash or a cancellation. A
    call cut mid-stream is not one: its input never arrived whole, so it never runs and never
    gets a result (it is superseded, see `superseded_on_close`)."""
    answered = {p.content.tool_call_id for p in parts if isinstance(p.content, ToolResult)}
    return [
        p
        for p in parts
        if is_whole_call(p)
        and not p.superseded
        and isinstance(p.content, ToolCall)
        and p.content.tool_call_id not in answered
    ]


def interrupted_results(
    parts: Sequence[Part], reason: str, next_index: int
) -> tuple[list[Part], list[Event]]:
    """Close every dangling call with an error result saying why, from position `next_index`
    on: the new parts and their events (part.added, tool.failed)."""
    new_parts: list[Part] = []
    events: list[Event] = []
    for call in dangling_tool_calls(parts):
        assert isinstance(call.content, ToolCall)
        result = Part(
            next_index + len(new_parts),
            Role.TOOL,
            ToolResult(call.content.tool_call_id, f"interrupted: {reason}", is_error=True),
            final=True,
        )
        new_parts.append(result)
        events.append(part_added(result))
        events.append(
            tool_failed(
                call.content.tool_call_id,
                call.content.name,
                RunError("tool_interrupted", reason, retryable=True),
            )
        )
    return new_parts, events


def superseded_on_close(parts: Sequence[Part], *, regenerated: bool) -> list[Part]:
    """The parts an attempt that is over leaves superseded (kept for audit, out of every
    transcript read and of the model's history).

    Always the tool calls whose input never arrived whole: never run, never sent back. And when
    another attempt follows (`regenerated`: a retry, a reaped or a released lease), every part
    of the model turn the attempt did not see to its end, because the next attempt asks the
    model again and streams the turn anew. That turn is the model output after the run's last
    tool result or pause marker, and it counts as unfinished only while it holds no whole call:
    a whole call means the model's turn stands (its call is run, or closed as interrupted, and
    the model answers the result). A terminal end keeps its unfinished text: it is the last
    thing the model said and nothing will say it again."""
    live = [p for p in parts if not p.superseded]
    marked = {p.index: p for p in live if p.kind is PartKind.TOOL_CALL and not p.final}
    if regenerated:
        turn: list[Part] = []
        for part in reversed(live):
            if part.kind not in _MODEL_OUTPUT:
                break
            turn.append(part)
        if not any(is_whole_call(p) for p in turn):
            marked.update((p.index, p) for p in turn)
    return [marked[i] for i in sorted(marked)]


@dataclass(frozen=True, slots=True)
class Closing:
    """What settles an attempt that is over: new parts, parts superseded, and their events."""

    parts: list[Part]
    superseded: list[Part]
    events: list[Event]


def close_attempt(
    parts: Sequence[Part], attempt: int, *, regenerated: bool, interrupted: str | None
) -> Closing:
    """Settle attempt number `attempt`, which is over: its superseded parts (see
    `superseded_on_close`) each announced by part.superseded and, with an `interrupted`
    reason, an error result closing every dangling whole call (without one, the next attempt
    runs those calls)."""
    superseded = superseded_on_close(parts, regenerated=regenerated)
    events = [part_superseded(p.index, attempt) for p in superseded]
    new_parts: list[Part] = []
    if interrupted is not None:
        next_index = max((p.index for p in parts), default=-1) + 1
        new_parts, closed = interrupted_results(parts, interrupted, next_index)
        events.extend(closed)
    return Closing(new_parts, superseded, events)


# -- event constructors: each event's payload is built here and nowhere else ---------------------


def run_queued(attempt: int, reason: str) -> Event:
    """The run waits for a worker (admitted, resumed, released, requeued or due for a retry)."""
    payload: dict[str, Any] = {"reason": reason}
    if attempt:
        payload["attempt"] = attempt
    return Event(EventType.RUN_QUEUED, payload)


def run_started(attempt: int, worker_id: str, lease_epoch: int) -> Event:
    """A worker leased the run."""
    return Event(
        EventType.RUN_STARTED,
        {"attempt": attempt, "workerId": worker_id, "leaseEpoch": lease_epoch},
    )


def run_completed(done: Completed, usage: Mapping[str, int]) -> Event:
    """The runtime answered (see `Completed`)."""
    return Event(
        EventType.RUN_COMPLETED,
        {
            "resultText": done.result_text,
            "taskOutcome": done.task_outcome,
            "warnings": list(done.warnings),
            "usage": _usage_json(usage),
        },
    )


def run_failed(error: RunError) -> Event:
    """The run failed for good."""
    return Event(EventType.RUN_FAILED, {"error": error.to_json()})


def run_cancelled(reason: str) -> Event:
    """The run ended cancelled."""
    return Event(EventType.RUN_CANCELLED, {"reason": reason})


def run_retry_pending(attempt: int, max_attempts: int, next_at_iso: str, error: RunError) -> Event:
    """A transient failure: the next attempt starts at `next_at_iso` (RFC 3339, UTC)."""
    return Event(
        EventType.RUN_RETRY_PENDING,
        {
            "attempt": attempt,
            "maxAttempts": max_attempts,
            "nextAttemptAt": next_at_iso,
            "error": error.to_json(),
        },
    )


def part_added(part: Part) -> Event:
    """A new part, whole as it stands."""
    return Event(EventType.PART_ADDED, {"part": part_json(part)})


def part_updated(part: Part) -> Event:
    """A part rewritten (finished, as a rule), whole as it stands."""
    return Event(EventType.PART_UPDATED, {"part": part_json(part)})


def part_superseded(index: int, attempt: int) -> Event:
    """A later attempt took the part's place: a client drops what it rendered of it."""
    return Event(EventType.PART_SUPERSEDED, {"partIndex": index, "attempt": attempt})


def tool_started(tool_call_id: str, name: str) -> Event:
    """A call started running."""
    return Event(EventType.TOOL_STARTED, {"toolCallId": tool_call_id, "name": name})


def tool_completed(tool_call_id: str, name: str, *, replayed: bool = False) -> Event:
    """A call finished; `replayed` when its stored result stood in for firing it again."""
    payload: dict[str, Any] = {"toolCallId": tool_call_id, "name": name}
    if replayed:
        payload["replayed"] = True
    return Event(EventType.TOOL_COMPLETED, payload)


def tool_failed(tool_call_id: str, name: str, error: RunError) -> Event:
    """A call failed, was refused or was interrupted."""
    return Event(
        EventType.TOOL_FAILED,
        {"toolCallId": tool_call_id, "name": name, "error": error.to_json()},
    )


def interaction_event(type_: EventType, interaction_id: str, **detail: str) -> Event:
    """A question, approval or connection was requested or resolved (`detail`: the decision
    or outcome)."""
    return Event(type_, {"interactionId": interaction_id, **detail})


def usage_updated(turn: ModelTurn, total: Mapping[str, int]) -> Event:
    """One model turn's usage, and the attempt's total so far."""
    return Event(
        EventType.USAGE_UPDATED,
        {
            "turn": {
                "model": turn.model,
                **_usage_json({**turn.tokens(), "cost_micros": turn.cost_micros}),
            },
            "total": _usage_json(total),
        },
    )


def text_delta(part_index: int, text: str, offset: int) -> Event:
    """Live tokens of a streaming text part (ephemeral: never stored)."""
    return Event(EventType.TEXT_DELTA, {"partIndex": part_index, "text": text, "offset": offset})


def _usage_json(usage: Mapping[str, int]) -> dict[str, int]:
    return {camel(k): v for k, v in usage.items() if v}
