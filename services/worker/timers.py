"""The built-in `wait_until` tool: what it offers the model, the one check of its input, and the
words the model reads when it wakes.

A wait never holds a worker: the call's due time is recorded as a timer marker, the attempt
raises Parked, and the orchestrator wakes the run when due (`services.orchestrator.timers`). The
resumed attempt answers the call with the time it woke, or parks again if it came back early (a
worker that died between recording the marker and parking).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

WAIT_UNTIL = "wait_until"

WAIT_UNTIL_SPEC: dict[str, Any] = {
    "name": WAIT_UNTIL,
    "description": (
        "Pause this run until a time, then carry on where you left off: nothing runs and no "
        "worker is held meanwhile. Give exactly one of `until` (an absolute RFC 3339 time with "
        "its offset, e.g. 2026-12-05T10:00:00Z) or `seconds` (how long to wait). The result "
        "says when you woke."
    ),
    "input_schema": {
        "type": "object",
        "properties": {
            "until": {"type": "string", "description": "RFC 3339 time with offset"},
            "seconds": {"type": "number", "exclusiveMinimum": 0},
        },
    },
}

# A run back this close to its due time woke from its timer: the worker's clock may trail the
# database's, whose clock the waker goes by, by this much without parking the run again.
CLOCK_SLACK_S = 2.0


class WaitRefused(Exception):
    """A `wait_until` input the model must correct; the message says how."""


def rfc3339(when: datetime) -> str:
    """`when` in UTC, as the model and the events read it."""
    return when.astimezone(UTC).isoformat().replace("+00:00", "Z")


def due_time(input: Mapping[str, Any], now: datetime, max_wait_s: float) -> datetime:
    """When a `wait_until` call with `input`, made at `now`, is due: whole seconds, rounded up.
    WaitRefused when it gives neither or both of `until` and `seconds`, a time that does not
    parse or has no offset, one not in the future, or a wait beyond `max_wait_s`."""
    until, seconds = input.get("until"), input.get("seconds")
    if (until is None) == (seconds is None):
        raise WaitRefused("give exactly one of `until` (an RFC 3339 time) or `seconds`")
    if seconds is not None:
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            raise WaitRefused("`seconds` must be a number")
        if not math.isfinite(seconds) or seconds <= 0:
            raise WaitRefused("`seconds` must be a positive number")
        if seconds > max_wait_s:
            raise WaitRefused(f"`seconds` may be at most {max_wait_s:g} (this agent's limit)")
        due = now + timedelta(seconds=seconds)
    else:
        if not isinstance(until, str):
            raise WaitRefused("`until` must be an RFC 3339 time such as 2026-12-05T10:00:00Z")
        try:
            due = datetime.fromisoformat(until)
        except ValueError:
            raise WaitRefused(
                f"`until` {until!r} is not an RFC 3339 time such as 2026-12-05T10:00:00Z"
            ) from None
        if due.tzinfo is None:
            raise WaitRefused(f"`until` {until!r} has no offset: add one, such as Z or +02:00")
        if due <= now:
            raise WaitRefused(f"`until` {rfc3339(due)} is not in the future (now {rfc3339(now)})")
        if due - now > timedelta(seconds=max_wait_s):
            latest = rfc3339(now + timedelta(seconds=max_wait_s))
            raise WaitRefused(
                f"`until` {rfc3339(due)} is beyond this agent's longest wait of "
                f"{max_wait_s:g} s (the latest is {latest})"
            )
    due = due.astimezone(UTC)
    if due.microsecond:
        due = due.replace(microsecond=0) + timedelta(seconds=1)
    return due


def woken(due: datetime, now: datetime) -> bool:
    """Whether a run resumed at `now` woke from its timer due at `due` (see CLOCK_SLACK_S)."""
    return now >= due - timedelta(seconds=CLOCK_SLACK_S)


def woke_text(due: datetime, now: datetime) -> str:
    """The call's result: when the run woke, and when it was due."""
    return f"woke at {rfc3339(now.replace(microsecond=0))} (due {rfc3339(due)})"
