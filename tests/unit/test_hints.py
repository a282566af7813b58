"""The Redis message codecs: what one side encodes the other decodes, the previous release's
forms still decode, and junk or a newer format is refused (the subscriber ignores it)."""

from __future__ import annotations

import fnmatch
import json

import pytest

from tether.hints import (
    CANCEL_PATTERN,
    EVENTS_PATTERN,
    HINT_FORMAT,
    SENTINEL_CHANNEL,
    WAKE_CHANNEL,
    Audience,
    CancelHint,
    LiveMessage,
    Wake,
    cancel_channel,
    decode_cancel,
    decode_events,
    decode_wake,
    encode_cancel,
    encode_events,
    encode_wake,
    events_channel,
)


def test_a_live_event_round_trips() -> None:
    message = LiveMessage("run_1", 7, "part.added", {"partIndex": 0}, "2026-12-01T00:00:00+00:00")
    assert decode_events(encode_events([message])) == [message]
    assert decode_events(encode_events([message]).encode()) == [message]


@pytest.mark.parametrize("owner", ["alice", ""])
def test_whose_run_it_is_round_trips_and_the_release_before_reads_past_it(owner: str) -> None:
    audience = Audience("ten_1", owner)
    message = LiveMessage("run_1", 3, "run.started", {}, "2026-12-01T00:00:00+00:00", 1, audience)
    encoded = encode_events([message])
    assert decode_events(encoded) == [message]
    raw = json.loads(encoded)
    # The release before reads run_id, format and events, and no other key.
    assert {k: raw[k] for k in ("run_id", "format")} == {"run_id": "run_1", "format": 1}
    assert [e["seq"] for e in raw["events"]] == [3]


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
def test_a_wake_round_trips_saying_its_format(run_id: str, origin: str) -> None:
    encoded = encode_wake(run_id, origin)
    assert json.loads(encoded)["format"] == HINT_FORMAT
    assert decode_wake(encoded) == Wake(run_id, origin)
    assert decode_wake(encoded.encode()) == Wake(run_id, origin)


@pytest.mark.parametrize(
    ("bare", "wake"),
    [
        ("run_1", Wake("run_1")),
        (b"run_1@orchestrator-ab12", Wake("run_1", "orchestrator-ab12")),
        ("", Wake("")),
        ("@orchestrator-ab12", Wake("", "orchestrator-ab12")),
    ],
)
def test_the_previous_releases_bare_wakes_decode(bare: str | bytes, wake: Wake) -> None:
    assert decode_wake(bare) == wake


@pytest.mark.parametrize(
    "junk",
    [
        json.dumps({"format": HINT_FORMAT + 1, "run_id": "run_1", "origin": ""}),
        json.dumps({"format": HINT_FORMAT, "run_id": 7}),
        "{not json",
        "{}",
    ],
)
def test_a_newer_or_undecodable_wake_is_a_value_error(junk: str) -> None:
    with pytest.raises(ValueError):
        decode_wake(junk)


@pytest.mark.parametrize("reason", ["", "the user changed their mind", '{"format": 1}'])
def test_a_cancel_hint_round_trips_saying_its_format(reason: str) -> None:
    encoded = encode_cancel(reason)
    assert json.loads(encoded)["format"] == HINT_FORMAT
    channel = cancel_channel("run_1")
    assert decode_cancel(channel, encoded) == CancelHint("run_1", reason)
    assert decode_cancel(channel.encode(), encoded.encode()) == CancelHint("run_1", reason)


@pytest.mark.parametrize("bare", ["cancelled", "", "{half a brace"])
def test_the_previous_releases_bare_cancel_hint_decodes(bare: str) -> None:
    assert decode_cancel(cancel_channel("run_1").encode(), bare.encode()) == CancelHint(
        "run_1", bare
    )


def test_a_newer_cancel_hint_or_another_channel_is_a_value_error() -> None:
    newer = json.dumps({"format": HINT_FORMAT + 1, "reason": "x"})
    with pytest.raises(ValueError, match="newer"):
        decode_cancel(cancel_channel("run_1"), newer)
    with pytest.raises(ValueError):
        decode_cancel(events_channel("run_1"), encode_cancel("x"))


def test_channels_match_their_patterns_and_the_sentinel_matches_none() -> None:
    assert fnmatch.fnmatchcase(cancel_channel("run_1"), CANCEL_PATTERN)
    assert fnmatch.fnmatchcase(events_channel("run_1"), EVENTS_PATTERN)
    for pattern in (CANCEL_PATTERN, EVENTS_PATTERN):
        assert not fnmatch.fnmatchcase(SENTINEL_CHANNEL, pattern)
    assert SENTINEL_CHANNEL != WAKE_CHANNEL
