"""The `wait_until` tool's input check: exactly one of `until` and `seconds`, in the future and
within the agent's longest wait; anything else is refused with words the model can act on."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from services.worker.timers import (
    CLOCK_SLACK_S,
    WaitRefused,
    due_time,
    woke_text,
    woken,
)
from tether.convert import event_to_proto, part_from_proto, part_to_proto
from tether.domain import (
    Part,
    Role,
    TimerMarker,
    part_from_json,
    part_json,
    timer_fired,
    timer_set,
)

NOW = datetime(2026, 12, 5, 9, 0, 0, 250_000, tzinfo=UTC)
WEEK = 7 * 24 * 3600.0


def test_seconds_count_from_now_and_round_up_to_a_whole_second() -> None:
    assert due_time({"seconds": 2}, NOW, WEEK) == datetime(2026, 12, 5, 9, 0, 3, tzinfo=UTC)
    assert due_time({"seconds": 1.5}, NOW, WEEK) == datetime(2026, 12, 5, 9, 0, 2, tzinfo=UTC)


def test_until_is_taken_as_given_in_utc() -> None:
    due = due_time({"until": "2026-12-05T12:00:00+02:00"}, NOW, WEEK)
    assert due == datetime(2026, 12, 5, 10, 0, 0, tzinfo=UTC)
    assert due_time({"until": "2026-12-05T10:00:00Z"}, NOW, WEEK) == due


def test_exactly_the_limit_is_allowed() -> None:
    exact = NOW.replace(microsecond=0) + timedelta(seconds=WEEK)
    assert due_time({"until": exact.isoformat()}, NOW.replace(microsecond=0), WEEK) == exact
    assert due_time({"seconds": WEEK}, NOW, WEEK) > NOW


@pytest.mark.parametrize(
    ("input", "words"),
    [
        ({}, "exactly one of"),
        ({"until": "2026-12-05T10:00:00Z", "seconds": 5}, "exactly one of"),
        ({"seconds": 0}, "positive"),
        ({"seconds": -3}, "positive"),
        ({"seconds": float("nan")}, "positive"),
        ({"seconds": "5"}, "must be a number"),
        ({"seconds": True}, "must be a number"),
        ({"seconds": WEEK + 1}, "at most 604800"),
        ({"until": "tomorrow at ten"}, "not an RFC 3339 time"),
        ({"until": 1_800_000_000}, "must be an RFC 3339 time"),
        ({"until": "2026-12-05T10:00:00"}, "has no offset"),
        ({"until": "2026-12-05T08:59:59Z"}, "not in the future"),
        ({"until": "2026-12-05T09:00:00.250000Z"}, "not in the future"),
        ({"until": "2026-12-12T09:00:01Z"}, "beyond this agent's longest wait"),
    ],
)
def test_a_wait_the_model_must_correct_is_refused_saying_why(
    input: dict[str, object], words: str
) -> None:
    with pytest.raises(WaitRefused) as refused:
        due_time(input, NOW, WEEK)
    assert words in str(refused.value)


def test_the_agents_own_limit_bounds_the_wait() -> None:
    with pytest.raises(WaitRefused, match="at most 60"):
        due_time({"seconds": 61}, NOW, 60)
    assert due_time({"seconds": 60}, NOW, 60) == datetime(2026, 12, 5, 9, 1, 1, tzinfo=UTC)


def test_a_run_back_before_its_due_time_did_not_wake_but_clock_skew_is_forgiven() -> None:
    due = datetime(2026, 12, 5, 10, 0, 0, tzinfo=UTC)
    assert woken(due, due)
    assert woken(due, due - timedelta(seconds=CLOCK_SLACK_S))
    assert not woken(due, due - timedelta(seconds=CLOCK_SLACK_S + 1))
    assert not woken(due, NOW)


def test_the_model_reads_when_it_woke_and_when_it_was_due() -> None:
    due = datetime(2026, 12, 5, 10, 0, 0, tzinfo=UTC)
    woke = datetime(2026, 12, 5, 10, 0, 1, 734_000, tzinfo=UTC)
    assert woke_text(due, woke) == "woke at 2026-12-05T10:00:01Z (due 2026-12-05T10:00:00Z)"


def test_the_timer_events_carry_their_due_time_as_their_union_members() -> None:
    set_ = timer_set("toolu_1", "2026-12-05T10:00:00Z")
    fired = timer_fired("2026-12-05T10:00:00Z")
    wire_set = event_to_proto("run_x", 4, set_.type, set_.payload, NOW)
    wire_fired = event_to_proto("run_x", 5, fired.type, fired.payload, NOW)
    assert wire_set.WhichOneof("payload") == "timer_set" and wire_set.type == "timer.set"
    assert wire_set.timer_set.tool_call_id == "toolu_1"
    assert wire_set.timer_set.due_at.ToJsonString() == "2026-12-05T10:00:00Z"
    assert wire_fired.WhichOneof("payload") == "timer_fired"
    assert wire_fired.timer_fired.due_at.ToJsonString() == "2026-12-05T10:00:00Z"


def test_a_timer_part_round_trips_through_its_proto_and_json_forms() -> None:
    part = Part(3, Role.ASSISTANT, TimerMarker("toolu_1", "2026-12-05T10:00:00Z"), final=True)
    assert part_from_proto(part_to_proto(part)) == part
    assert part_from_json(part_json(part)) == part
    assert part_json(part)["timer"] == {"toolCallId": "toolu_1", "dueAt": "2026-12-05T10:00:00Z"}
