"""Stored formats: the version each stored payload is written in, and how this release reads the
one before it.

A rolling deploy runs two releases side by side, so each must read what the other writes. Every
stored payload (a run's parts, events and JSON columns, an interaction's questions, answers and
input, a live message on Redis) records its format: the oldest one that reads it whole, so a
release before this one reads every payload it could read before. This release writes
`CURRENT`, and `BY_REFERENCE` for the one payload that format changed (see below); it reads
`OLDEST` to `NEWEST` (upgrading an older one as it reads), and refuses a newer format, or a
field it does not know, with StoredFormatTooNew: never a payload read with a field dropped.

Formats:
- 1: rows stored before formats were recorded (the column's default, and what a release that
  does not know the column writes). A tool call cut mid-stream may carry `cut: true`, the form
  before parts were superseded.
- 2: the domain's JSON forms (`tether.domain.part_json`, the event constructors). A cut call is
  superseded (`run_parts.superseded_at`, `Part.superseded`) and never carries `cut`.
- 3: a stored run.completed carries neither `resultText` nor `usage`: the answer is stored once,
  as the run's parts and `runs.result_text`, and the total once, as `runs.usage`; a reader fills
  both in from the run (`fill_completed`). Every other payload is unchanged from 2, and is still
  written as 2. The orchestrator writes run.completed as 2 while a release before this one
  still runs (`TETHER_ORCHESTRATOR_STORED_FORMAT=2` during a rolling deploy from it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from tether.domain import (
    EventType,
    LoggedEvent,
    Part,
    PartKind,
    completed_by_reference,
    content_from_json,
    part_from_json,
)
from tether.errors import StoredFormatTooNew

CURRENT = 2
BY_REFERENCE = 3
NEWEST = BY_REFERENCE
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
    if format == BY_REFERENCE and type_ == EventType.RUN_COMPLETED and ANSWER not in data:
        # A reader fills it in from the run before it converts it (`fill_completed`): reaching
        # here without it is this release's own mistake, never the stored row's.
        raise RuntimeError(f"{what} was read without its run's answer (fill_completed)")
    if type_ in (EventType.PART_ADDED, EventType.PART_UPDATED):
        try:
            part_from_json(data.get("part") or {})  # the part it carries is the domain's
        except (ValueError, TypeError) as exc:
            raise StoredFormatTooNew(f"{what} cannot be read by this release: {exc}") from exc
    return data


ANSWER = "resultText"


def written(type_: str, payload: Mapping[str, Any]) -> int:
    """The format an event is stored in: the oldest that reads it whole (see the module)."""
    if type_ == EventType.RUN_COMPLETED and ANSWER not in payload:
        return BY_REFERENCE
    return CURRENT


def fill_completed(
    event: LoggedEvent, result_text: str | None, usage: Mapping[str, int]
) -> LoggedEvent:
    """A stored event as its readers take it: a run.completed stored by reference
    (BY_REFERENCE) with the answer and usage its run keeps (`runs.result_text`, `runs.usage`);
    any other event as it is."""
    if event.format != BY_REFERENCE or event.type != EventType.RUN_COMPLETED:
        return event
    return replace(event, payload=completed_by_reference(event.payload, result_text, usage))
