"""The rules on parts that the orchestrator and the worker both apply: which tool calls dangle,
how an interrupted call is closed, and what an attempt that is over leaves superseded."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from tether.domain.events import Event, part_added, part_superseded, tool_failed
from tether.domain.outcomes import RunError
from tether.domain.parts import Part, PartKind, Role, ToolCall, ToolResult


class Interruption(StrEnum):
    """Why a tool call left open was closed unanswered: the words its error result and its
    tool.failed event carry, the same whichever service closes it."""

    RUN_FAILED = "the run failed"
    RUN_CANCELLED = "the run was cancelled"
    LIMIT_REACHED = "the run reached a limit"
    MODEL_CALL_FAILED = "the model call failed"
    WORKER_SHUT_DOWN = "the worker shut down"
    LEASE_LOST = "the worker lost its lease"
    CONNECTION_NEVER_COMPLETED = "the connection was never completed"


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


# Calls a later attempt of the same run issues again rather than losing: a `delegate` call's
# child is keyed by the run and the call (one per call, however often it is issued), so an
# attempt that follows a lost lease finds the child the dead one started instead of the model
# being told the call failed and starting another.
REISSUED_CALLS = frozenset({"delegate"})


def interrupted_results(
    parts: Sequence[Part],
    reason: Interruption,
    next_index: int,
    *,
    keep: frozenset[str] = frozenset(),
) -> tuple[list[Part], list[Event]]:
    """Close every dangling call (but those named in `keep`, which the next attempt issues
    again) with an error result saying why, from position `next_index` on: the new parts and
    their events (part.added, tool.failed)."""
    new_parts: list[Part] = []
    events: list[Event] = []
    for call in dangling_tool_calls(parts):
        assert isinstance(call.content, ToolCall)
        if call.content.name in keep:
            continue
        result = Part(
            next_index + len(new_parts),
            Role.TOOL,
            ToolResult(call.content.tool_call_id, f"interrupted: {reason.value}", is_error=True),
            final=True,
        )
        new_parts.append(result)
        events.append(part_added(result))
        events.append(
            tool_failed(
                call.content.tool_call_id,
                call.content.name,
                RunError("tool_interrupted", reason.value, retryable=True),
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
    parts: Sequence[Part],
    attempt: int,
    *,
    regenerated: bool,
    interrupted: Interruption | None,
    keep: frozenset[str] = frozenset(),
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
        new_parts, closed = interrupted_results(parts, interrupted, next_index, keep=keep)
        events.extend(closed)
    return Closing(new_parts, superseded, events)
