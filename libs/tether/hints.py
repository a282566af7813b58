"""Every message Tether carries on Redis: its channel and its encoding, in one place.

Publishers and subscribers in different services use these functions, never their own string
formats, so a change to a message is made once. Every message is a hint (see `tether.bus`):
a subscriber that cannot decode one drops it and re-reads PostgreSQL.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tether import formats

# -- wake-ups: "a run may have become claimable" ------------------------------------------------

WAKE_CHANNEL = "tether:wake"


def encode_wake(run_id: str, origin: str = "") -> str:
    """`RUN_ID` ("" for a run not known by id), or `RUN_ID@ORIGIN` from an orchestrator replica
    that already woke its own waiting claims."""
    return f"{run_id}@{origin}" if origin else run_id


def decode_wake(data: bytes | str) -> tuple[str, str]:
    """(run id, origin replica or "")."""
    run_id, _, origin = _text(data).partition("@")
    return run_id, origin


# -- cancel hints: "ask the orchestrator whether this run was cancelled" ------------------------

_CANCEL_PREFIX = "tether:cancel:"
CANCEL_PATTERN = _CANCEL_PREFIX + "*"


def cancel_channel(run_id: str) -> str:
    """Channel a run's cancel hint is published on: it makes the worker holding the run ask the
    orchestrator, which alone says whether a cancel was requested."""
    return _CANCEL_PREFIX + run_id


def run_of_cancel_channel(channel: bytes | str) -> str:
    """The run a cancel hint names (its channel is the message; the body is only a reason)."""
    return _text(channel).removeprefix(_CANCEL_PREFIX)


# -- live events: committed events and uncommitted text deltas, for the gateway's streams -------


_EVENTS_PREFIX = "tether:events:"
EVENTS_PATTERN = _EVENTS_PREFIX + "*"


def events_channel(run_id: str) -> str:
    """Channel a run's committed events and live deltas are published on."""
    return _EVENTS_PREFIX + run_id


@dataclass(frozen=True)
class LiveMessage:
    """One live event as published: `seq` 0 for an uncommitted delta; `created_at` is an ISO
    time, or "" when the publisher did not stamp it; `format` the stored format its payload is
    in (`tether.formats`: a release reads its own and the one before)."""

    run_id: str
    seq: int
    type: str
    payload: Mapping[str, Any]
    created_at: str = ""
    format: int = formats.CURRENT


def encode_events(messages: Sequence[LiveMessage]) -> str:
    """The JSON form published on the run's channel (`events_channel`): the events of one run,
    in seq order, as one message (a commit's events go out together: one publish, not one
    each)."""
    first = messages[0]
    events = []
    for message in messages:
        event: dict[str, Any] = {
            "seq": message.seq,
            "type": message.type,
            "payload": dict(message.payload),
        }
        if message.created_at:
            event["created_at"] = message.created_at
        events.append(event)
    return json.dumps({"run_id": first.run_id, "format": first.format, "events": events})


def decode_events(data: bytes | str) -> list[LiveMessage]:
    """The events `encode_events` wrote (or, from the release before, one event alone);
    ValueError when it is no such message, or when a newer release wrote it in a format this
    one does not read (the subscriber re-reads PostgreSQL)."""
    try:
        raw = json.loads(data)
        run_id = str(raw["run_id"])
        # Releases before formats were recorded published format 1 without saying so.
        format = int(raw.get("format", 1))
        events = raw.get("events", [raw])  # the release before sent one event alone
        messages = [
            LiveMessage(
                run_id,
                int(event["seq"]),
                str(event["type"]),
                event.get("payload") or {},
                str(event.get("created_at") or ""),
                format,
            )
            for event in events
        ]
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a live event: {exc}") from exc
    if format > formats.CURRENT:
        raise ValueError(f"a live event in format {format}, newer than this release reads")
    return messages


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
