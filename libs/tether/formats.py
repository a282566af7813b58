"""Stored formats: the version each stored payload is written in, and how this release reads the
one before it.

A rolling deploy runs two releases side by side, so each must read what the other writes. Every
stored payload (a run's parts, events and JSON columns, an interaction's questions, answers and
input, a live message on Redis) records its format: the oldest one that reads it whole, so a
release before this one reads every payload it could read before. This release writes
`CURRENT`, and `BY_REFERENCE` for the events that format stores by reference (below); it reads
`OLDEST` to `NEWEST` (upgrading an older one as it reads), and refuses a newer format, or a
field it does not know, with StoredFormatTooNew: never a payload read with a field dropped.

Formats:
- 1: rows stored before formats were recorded (the column's default, and what a release that
  does not know the column writes). A tool call cut mid-stream may carry `cut: true`, the form
  before parts were superseded.
- 2: the domain's JSON forms (`tether.domain.part_json`, the event constructors). A cut call is
  superseded (`run_parts.superseded_at`, `Part.superseded`) and never carries `cut`.
- 3: events stored by reference, without what their run's rows keep whole
  (`tether.domain.stored_by_reference`): run.completed without `resultText` and `usage`
  (`runs.result_text`, `runs.usage`), and part.added and part.updated of a final part as its
  `partIndex` (its `run_parts` row). A reader fills them in from those rows (`fill`). Every
  other payload is unchanged from 2, and is still written as 2. The orchestrator stores them
  whole, as 2, while a release before this one still runs (`TETHER_ORCHESTRATOR_STORED_FORMAT=2`
  during a rolling deploy from it).
- 4: usage.updated stored without its `turn`, which its `usage_turns` row keeps (the row names
  the event's seq, `usage_turns.event_seq`); it keeps the attempt's running `total`. A reader
  fills the turn in from that row (`fill`). The release before this one reads 3 and would take
  such a payload as whole, with its turn dropped, so it is a format of its own, which that
  release refuses; the orchestrator writes it only once no replica of that release runs
  (`TETHER_ORCHESTRATOR_STORED_FORMAT=3` during a rolling deploy from it).
- 5: a completed run's answer stored once, as its parts: `runs.result_text` is NULL and
  `runs.format` 5, and the answer is its text parts after its last part that is not the
  assistant's (`services/orchestrator/repositories/answers.py`, the one rule the completion
  checks and every reader reads by). The completion stores it so only when that rule gives the
  worker's answer exactly (a run a limit stopped answers with every turn's text, and keeps it
  whole). The release before reads `runs.result_text` and would show such a run with no
  answer, so the row's format is 5, which that release refuses; the orchestrator stores the
  answer whole while a replica of that release runs (`TETHER_ORCHESTRATOR_STORED_FORMAT=4`
  during a rolling deploy from it).
- 6: the events one write appends together stored as one row (`EVENTS_TOGETHER`), as a
  broker stores a batch of records: `run_events.type` is `events`, `seq` the last of theirs,
  and the payload the list of `[type, format, payload]` of each, in order, each in its own
  format (2 to 5). The `run_event_log` view reads every row as the events it holds, each with
  its own seq (`seq` less how many follow it), so a reader takes events from there and never
  from `run_events`. A write of one event stores it in a row of its own, as before. The
  release before reads `run_events` one row an event, and refuses a format-6 row; the
  orchestrator stores one row an event while a replica of that release runs
  (`TETHER_ORCHESTRATOR_STORED_FORMAT=5` during a rolling deploy from it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from tether.domain import (
    EventType,
    LoggedEvent,
    ModelTurn,
    Part,
    PartKind,
    content_from_json,
    filled_by_reference,
    part_from_json,
)
from tether.errors import StoredFormatTooNew

CURRENT = 2
BY_REFERENCE = 3
USAGE_BY_REFERENCE = 4
ANSWER_BY_REFERENCE = 5
EVENTS_TOGETHER = 6
NEWEST = EVENTS_TOGETHER
# `run_events.type` of a row that holds the events one write appended (EVENTS_TOGETHER).
TOGETHER_TYPE = "events"
OLDEST = 1
_READABLE = [OLDEST, NEWEST]


def check(format: int, what: str) -> None:
    """Refuse `what` (e.g. "run run_x") when a newer release wrote it in a format this one does
    not read."""
    if format > NEWEST:
        raise StoredFormatTooNew(
            f"{what} is stored in format {format}, newer than this release reads "
            f"({OLDEST}-{NEWEST}); a replica of the release that wrote it can read it",
            details={"format": format, "readable": _READABLE},
        )
    if format < OLDEST:
        raise StoredFormatTooNew(
            f"{what} is stored in format {format}, older than this release reads "
            f"({OLDEST}-{NEWEST}); migrate it with the release in between",
            code="stored_format_too_old",
            details={"format": format, "readable": _READABLE},
        )


def read_part(
    *,
    index: int,
    role: str,
    kind: str,
    payload: Mapping[str, Any],
    final: bool,
    superseded: bool,
    format: int,
    what: str,
) -> Part:
    """A stored part (`what` names it for an error), upgraded to the current format."""
    check(format, what)
    data = dict(payload)
    if format == 1 and kind == PartKind.TOOL_CALL and "cut" in data:
        superseded = bool(data.pop("cut")) or superseded
    try:
        content = content_from_json(kind, data)
    except (ValueError, TypeError) as exc:
        raise StoredFormatTooNew(f"{what} cannot be read by this release: {exc}") from exc
    return Part(index, role, content, final, superseded)


def read_event_payload(
    type_: str, payload: Mapping[str, Any], format: int, what: str
) -> dict[str, Any]:
    """A stored or live event's payload (`what` names it for an error), upgraded to the current
    format: the JSON of its union member."""
    check(format, what)
    if format == EVENTS_TOGETHER:
        # Rows of events stored together are read as their events (`run_event_log`): reaching
        # here with one is this release's own mistake, never the stored row's.
        raise RuntimeError(f"{what} is a row of events, read without run_event_log")
    data = dict(payload)
    if format == 1 and type_ in (EventType.PART_ADDED, EventType.PART_UPDATED):
        part = dict(data.get("part") or {})
        call = part.get("toolCall")
        if isinstance(call, Mapping) and "cut" in call:
            call = dict(call)
            if call.pop("cut"):
                part["superseded"] = True
            part["toolCall"] = call
            data["part"] = part
    if format >= BY_REFERENCE and written(type_, data) > CURRENT:
        # A reader fills it in from its run's rows before it converts it (`fill`): reaching
        # here without them is this release's own mistake, never the stored row's.
        raise RuntimeError(f"{what} was read without the rows it refers to (formats.fill)")
    if type_ in (EventType.PART_ADDED, EventType.PART_UPDATED):
        try:
            part_from_json(data.get("part") or {})  # the part it carries is the domain's
        except (ValueError, TypeError) as exc:
            raise StoredFormatTooNew(f"{what} cannot be read by this release: {exc}") from exc
    return data


# The events that may be stored by reference, each with the key its whole payload always has
# and its stored-by-reference form never does (`tether.domain.stored_by_reference`), and the
# format that form is stored in.
BY_REFERENCE_WITHOUT: dict[str, tuple[str, int]] = {
    EventType.RUN_COMPLETED: ("resultText", BY_REFERENCE),
    EventType.PART_ADDED: ("part", BY_REFERENCE),
    EventType.PART_UPDATED: ("part", BY_REFERENCE),
    EventType.USAGE_UPDATED: ("turn", USAGE_BY_REFERENCE),
}


def written(type_: str, payload: Mapping[str, Any]) -> int:
    """The format an event is stored in: the oldest that reads it whole (see the module)."""
    whole, by_reference = BY_REFERENCE_WITHOUT.get(type_, ("", CURRENT))
    return by_reference if whole and whole not in payload else CURRENT


def _by_reference(event: LoggedEvent) -> bool:
    return event.format >= BY_REFERENCE and written(event.type, event.payload) > CURRENT


def referenced_parts(events: Sequence[LoggedEvent]) -> list[int]:
    """The indexes of the parts `events` stored by reference name: what `fill` needs."""
    return sorted(
        {
            int(e.payload.get("partIndex", 0))
            for e in events
            if e.type in (EventType.PART_ADDED, EventType.PART_UPDATED) and _by_reference(e)
        }
    )


def referenced_turns(events: Sequence[LoggedEvent]) -> list[int]:
    """The seqs of the usage.updated events stored by reference among `events`: whose turns
    (`usage_turns.event_seq`) `fill` needs."""
    return [e.seq for e in events if e.type == EventType.USAGE_UPDATED and _by_reference(e)]


def fill(
    event: LoggedEvent,
    *,
    result_text: str | None,
    usage: Mapping[str, int],
    parts: Mapping[int, Part],
    turns: Mapping[int, ModelTurn] | None = None,
) -> LoggedEvent:
    """A stored event as its readers take it: one stored by reference (BY_REFERENCE,
    USAGE_BY_REFERENCE) whole again from its run's rows (`runs.result_text`, `runs.usage`,
    `parts` by index, at least those `referenced_parts` named, and `turns` by their events'
    seqs, at least those `referenced_turns` named); any other as it is."""
    if not _by_reference(event):
        return event
    payload = filled_by_reference(
        event.type,
        event.payload,
        result_text=result_text,
        usage=usage,
        parts=parts,
        turn=(turns or {}).get(event.seq),
    )
    return replace(event, payload=payload)
