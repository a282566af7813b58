"""The Redis message codecs: what one side encodes the other decodes, and junk is refused."""

from __future__ import annotations

import pytest

from tether.hints import (
    CANCEL_PATTERN,
    EVENTS_PATTERN,
    LiveMessage,
    cancel_channel,
    decode_events,
    decode_wake,
    encode_events,
    encode_wake,
    events_channel,
    run_of_cancel_channel,
)


def test_a_live_event_round_trips() -> None:
    message = LiveMessage("run_1", 7, "part.added", {"partIndex": 0}, "2026-12-01T00:00:00+00:00")
    assert decode_events(encode_events([message])) == [message]
    assert decode_events(encode_events([message]).encode()) == [message]


def test_a_commits_events_go_out_as_one_message_in_order() -> None:
    now = "2026-12-01T00:00:00+00:00"
    events = [
        LiveMessage("run_1", 4, "part.added", {"part": {"index": 0}}, now),
        LiveMessage("run_1", 5, "usage.updated", {"total": {}}, now),
        LiveMessage("run_1", 6, "run.completed", {"resultText": "ok"}, now),
    ]
    assert decode_events(encode_events(events)) == events


def test_the_previous_releases_one_event_messages_decode() -> None:
    older = '{"run_id": "run_1", "seq": 3, "type": "run.started", "payload": {"attempt": 1}}'
    assert decode_events(older) == [LiveMessage("run_1", 3, "run.started", {"attempt": 1}, "", 1)]


def test_a_delta_without_a_time_round_trips() -> None:
    delta = LiveMessage("run_1", 0, "text.delta", {"partIndex": 0, "text": "hi", "offset": 0})
    assert decode_events(encode_events([delta])) == [delta]


@pytest.mark.parametrize("junk", ["", "nope", "[]", "{}", '{"run_id": "r", "seq": "x"}', "null"])
def test_an_undecodable_event_is_a_value_error(junk: str) -> None:
    with pytest.raises(ValueError):
        decode_events(junk)


@pytest.mark.parametrize(("run_id", "origin"), [("run_1", ""), ("run_1", "replica-a"), ("", "r")])
def test_a_wake_round_trips(run_id: str, origin: str) -> None:
    assert decode_wake(encode_wake(run_id, origin)) == (run_id, origin)
    assert decode_wake(encode_wake(run_id, origin).encode()) == (run_id, origin)


def test_channels_match_their_patterns() -> None:
    assert cancel_channel("run_1").startswith(CANCEL_PATTERN.rstrip("*"))
    assert events_channel("run_1").startswith(EVENTS_PATTERN.rstrip("*"))
    assert run_of_cancel_channel(cancel_channel("run_1").encode()) == "run_1"
