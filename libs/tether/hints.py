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

# -- how wake-ups and cancel hints are written --------------------------------------------------

# The format of the wake-up and cancel-hint messages this release writes: JSON that says its
# format. 1 is the previous release's bare text (a wake-up `RUN_ID[@ORIGIN]`, a cancel hint's
# body its reason alone), never labelled, and still read. (Live events carry the stored format
# of their payloads instead: `LiveMessage.format`.)
HINT_FORMAT = 2


def _versioned(data: bytes | str, what: str) -> dict[str, Any] | None:
    """The body of a versioned hint; None for one in the previous release's bare form; ValueError
    for one a newer release wrote, in a format this one does not read."""
    text = _text(data)
    if not text.startswith("{"):
        return None
    try:
        raw = json.loads(text)
    except ValueError:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("format"), int):
        return None
    if raw["format"] > HINT_FORMAT:
        raise ValueError(f"a {what} in format {raw['format']}, newer than this release reads")
    return raw


# -- wake-ups: "a run may have become claimable" ------------------------------------------------

WAKE_CHANNEL = "tether:wake"


@dataclass(frozen=True, slots=True)
class Wake:
    """A run that may have become claimable (`run_id` "" for one not known by id); `origin` is
    the orchestrator replica that already woke its own waiting claims, or ""."""

    run_id: str
    origin: str = ""


def encode_wake(run_id: str, origin: str = "") -> str:
    """The message published on `WAKE_CHANNEL`. (The previous release reads it as a wake-up for
    a run not known by id, which still wakes a claim.)"""
    return json.dumps({"format": HINT_FORMAT, "run_id": run_id, "origin": origin})


def decode_wake(data: bytes | str) -> Wake:
    """The wake-up `encode_wake` wrote, or the previous release's `RUN_ID[@ORIGIN]`; ValueError
    when a newer release wrote it in a format this one does not read, or it is no wake-up."""
    raw = _versioned(data, "wake-up")
    if raw is None:
        text = _text(data)
        if text.startswith("{"):
            raise ValueError(f"not a wake-up: {text[:80]!r}")
        run_id, _, origin = text.partition("@")
        return Wake(run_id, origin)
    run_id, origin = raw.get("run_id", ""), raw.get("origin", "")
    if not isinstance(run_id, str) or not isinstance(origin, str):
        raise ValueError(f"not a wake-up: {raw!r}")
    return Wake(run_id, origin)


# -- cancel hints: "ask the orchestrator whether this run was cancelled" ------------------------

_CANCEL_PREFIX = "tether:cancel:"
CANCEL_PATTERN = _CANCEL_PREFIX + "*"


@dataclass(frozen=True, slots=True)
class CancelHint:
    """A caller asked to cancel `run_id`: whoever holds it asks the orchestrator, which alone
    says whether a cancel was requested (anyone can publish on Redis). `reason` is only for
    logs."""

    run_id: str
    reason: str = ""


def cancel_channel(run_id: str) -> str:
    """Channel a run's cancel hint is published on (the channel names the run)."""
    return _CANCEL_PREFIX + run_id


def encode_cancel(reason: str) -> str:
    """The message published on a run's `cancel_channel`."""
    return json.dumps({"format": HINT_FORMAT, "reason": reason})


def decode_cancel(channel: bytes | str, data: bytes | str) -> CancelHint:
    """The cancel hint `encode_cancel` wrote on `channel`, or the previous release's bare
    reason; ValueError when a newer release wrote it in a format this one does not read, or the
    channel is no cancel hint's."""
    name = _text(channel)
    if not name.startswith(_CANCEL_PREFIX):
        raise ValueError(f"not a cancel hint's channel: {name!r}")
    run_id = name.removeprefix(_CANCEL_PREFIX)
    raw = _versioned(data, "cancel hint")
    if raw is None:
        return CancelHint(run_id, _text(data))
    return CancelHint(run_id, str(raw.get("reason") or ""))


# -- live events: committed events and uncommitted text deltas, for the gateway's streams -------

_EVENTS_PREFIX = "tether:events:"
# Every run's events, for a subscriber of them all (the bench's completion listener).
EVENTS_PATTERN = _EVENTS_PREFIX + "*"


def events_channel(run_id: str) -> str:
    """Channel a run's committed events and live deltas are published on."""
    return _EVENTS_PREFIX + run_id


@dataclass(frozen=True)
class Audience:
    """Whose run a live message is about: its tenant and its owner principal ("" for a run
    admitted before owners were recorded), the two facts `tether.visibility` decides on. A
    gateway's live run lists wake only for runs their callers may see."""

    tenant_id: str
    owner_principal_id: str


@dataclass(frozen=True)
class LiveMessage:
    """One live event as published: `seq` 0 for an uncommitted delta; `created_at` is an ISO
    time, or "" when the publisher did not stamp it; `format` the stored format its payload is
    in (`tether.formats`: a release reads its own and the one before); `audience` whose run it
    is, or None when the publisher did not say (deltas, and the release before)."""

    run_id: str
    seq: int
    type: str
    payload: Mapping[str, Any]
    created_at: str = ""
    format: int = formats.CURRENT
    audience: Audience | None = None


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
    published: dict[str, Any] = {"run_id": first.run_id, "format": first.format}
    if first.audience is not None:
        # Keys the release before ignores: no new format.
        published["tenant_id"] = first.audience.tenant_id
        published["owner_principal_id"] = first.audience.owner_principal_id
    published["events"] = events
    return json.dumps(published)


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
        tenant_id = raw.get("tenant_id")
        audience = (
            Audience(str(tenant_id), str(raw.get("owner_principal_id") or ""))
            if tenant_id
            else None
        )
        messages = [
            LiveMessage(
                run_id,
                int(event["seq"]),
                str(event["type"]),
                event.get("payload") or {},
                str(event.get("created_at") or ""),
                format,
                audience,
            )
            for event in events
        ]
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a live event: {exc}") from exc
    if format > formats.NEWEST:
        raise ValueError(f"a live event in format {format}, newer than this release reads")
    return messages


# -- the subscription sentinel ------------------------------------------------------------------

# Subscribed last on every connection by `tether.runtime.subscription`, which counts the
# connection live once Redis confirms it; nothing is published on it.
SENTINEL_CHANNEL = "tether:subscription:sentinel"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
