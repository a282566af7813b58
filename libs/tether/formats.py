"""Stored formats: the version each stored payload is written in, and how this release reads the
one before it.

A rolling deploy runs two releases side by side, so each must read what the other writes. Every
stored payload (a run's parts, events and JSON columns, an interaction's questions, answers and
input, a live message on Redis) records its format. This release writes `CURRENT`, reads
`CURRENT` and `CURRENT - 1` (upgrading the older one as it reads), and refuses a newer format, or
a field it does not know, with StoredFormatTooNew: never a payload read with a field dropped.

Formats:
- 1: rows stored before formats were recorded (the column's default, and what a release that
  does not know the column writes). A tool call cut mid-stream may carry `cut: true`, the form
  before parts were superseded.
- 2: the domain's JSON forms (`tether.domain.part_json`, the event constructors). A cut call is
  superseded (`run_parts.superseded_at`, `Part.superseded`) and never carries `cut`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tether.domain import EventType, Part, PartKind, content_from_json, part_from_json
from tether.errors import StoredFormatTooNew

CURRENT = 2
PREVIOUS = CURRENT - 1


def check(format: int, what: str) -> None:
    """Refuse `what` (e.g. "run run_x") when a newer release wrote it in a format this one does
    not read."""
    if format > CURRENT:
        raise StoredFormatTooNew(
            f"{what} is stored in format {format}, newer than this release reads "
            f"({PREVIOUS}-{CURRENT}); a replica of the release that wrote it can read it",
            details={"format": format, "readable": [PREVIOUS, CURRENT]},
        )
    if format < PREVIOUS:
        raise StoredFormatTooNew(
            f"{what} is stored in format {format}, older than this release reads "
            f"({PREVIOUS}-{CURRENT}); migrate it with the release in between",
            code="stored_format_too_old",
            details={"format": format, "readable": [PREVIOUS, CURRENT]},
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
    if type_ in (EventType.PART_ADDED, EventType.PART_UPDATED):
        try:
            part_from_json(data.get("part") or {})  # the part it carries is the domain's
        except (ValueError, TypeError) as exc:
            raise StoredFormatTooNew(f"{what} cannot be read by this release: {exc}") from exc
    return data
