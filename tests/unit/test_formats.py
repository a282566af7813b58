"""Stored formats: the previous one is read and upgraded, a newer one (or a field this release
does not know) is refused rather than read with a field dropped."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

import pytest

from tether import formats
from tether.convert import event_to_proto
from tether.domain import (
    Completed,
    EventType,
    LoggedEvent,
    Part,
    Role,
    ToolCall,
    part_added,
    run_completed,
    run_completed_stored,
)
from tether.errors import StoredFormatTooNew
from tether.hints import LiveMessage, decode_events, encode_events

NOW = datetime(2026, 12, 6, tzinfo=UTC)

# The part.added a release before formats wrote for a call cut mid-stream (ToolCallPart.cut).
CUT_CALL_ADDED = {
    "part": {
        "index": 3,
        "role": "assistant",
        "toolCall": {"toolCallId": "toolu_1", "name": "publish_post", "cut": True},
    }
}


def test_a_cut_call_announced_in_format_1_reads_as_a_superseded_part() -> None:
    event = event_to_proto("run_1", 7, "part.added", CUT_CALL_ADDED, None, format=1)
    part = event.part_added.part
    assert part.superseded and not part.tool_call.cut and part.tool_call.name == "publish_post"


def test_cut_in_the_current_format_is_a_field_this_release_does_not_know() -> None:
    with pytest.raises(StoredFormatTooNew, match="event 7 of run run_1"):
        event_to_proto("run_1", 7, "part.added", CUT_CALL_ADDED, None, format=formats.CURRENT)


def test_an_event_in_a_newer_format_or_of_an_unknown_type_is_refused() -> None:
    payload = part_added(Part(0, Role.ASSISTANT, ToolCall("t", "x"), final=True)).payload
    with pytest.raises(StoredFormatTooNew, match="newer than this release reads"):
        event_to_proto("run_1", 1, "part.added", payload, None, format=formats.NEWEST + 1)
    with pytest.raises(StoredFormatTooNew, match="type this release does not know"):
        event_to_proto("run_1", 1, "part.renamed", payload, None)


def test_a_format_older_than_the_previous_is_refused_with_its_own_code() -> None:
    with pytest.raises(StoredFormatTooNew) as refused:
        formats.check(formats.OLDEST - 1, "run run_1")
    assert refused.value.code == "stored_format_too_old"


def test_live_messages_carry_their_format_and_a_newer_one_is_dropped() -> None:
    message = LiveMessage("run_1", 2, EventType.RUN_QUEUED, {"reason": "resumed"})
    assert decode_events(encode_events([message])) == [message]
    older = b'{"run_id": "run_1", "seq": 2, "type": "part.added", "payload": {}}'
    assert decode_events(older)[0].format == 1
    newer = encode_events([LiveMessage("run_1", 2, "run.queued", {}, format=formats.NEWEST + 1)])
    with pytest.raises(ValueError, match="newer than this release reads"):
        decode_events(newer)


def test_a_run_completed_stored_by_reference_reads_whole_once_filled_from_its_run() -> None:
    done = Completed("It is noon.", "resolved", ("max_steps_near",))
    usage = {"input_tokens": 140, "output_tokens": 12, "cache_read_input_tokens": 0}
    stored = run_completed_stored(done)
    assert formats.written(stored.type, stored.payload) == formats.BY_REFERENCE
    whole = run_completed(done, usage)
    assert formats.written(whole.type, whole.payload) == formats.CURRENT
    logged = LoggedEvent("run_1", 9, "run.completed", stored.payload, formats.BY_REFERENCE, NOW)
    filled = formats.fill_completed(logged, "It is noon.", usage)
    assert filled.payload == whole.payload
    event = event_to_proto("run_1", 9, filled.type, filled.payload, NOW, format=filled.format)
    assert event.run_completed.result_text == "It is noon."
    assert event.run_completed.usage.input_tokens == 140
    # Stored whole (a release before wrote it), or another event: read as it is.
    assert formats.fill_completed(replace(logged, format=2), "x", usage) == replace(
        logged, format=2
    )
    other = LoggedEvent("run_1", 1, "run.queued", {"reason": "admitted"}, 3, NOW)
    assert formats.fill_completed(other, "x", usage) is other


def test_a_run_completed_by_reference_read_without_its_run_is_this_releases_mistake() -> None:
    stored = run_completed_stored(Completed("answer")).payload
    with pytest.raises(RuntimeError, match="without its run's answer"):
        event_to_proto("run_1", 9, "run.completed", stored, NOW, format=formats.BY_REFERENCE)
