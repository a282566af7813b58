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
    Event,
    EventType,
    LoggedEvent,
    ModelTurn,
    Part,
    Role,
    Text,
    ToolCall,
    part_added,
    part_updated,
    run_completed,
    run_queued,
    stored_by_reference,
    usage_updated,
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


ANSWER = Part(4, Role.ASSISTANT, Text("It is noon."), final=True)


def _logged(event: Event, seq: int) -> LoggedEvent:
    return LoggedEvent(
        "run_1", seq, event.type, event.payload, formats.written(event.type, event.payload), NOW
    )


def test_events_stored_by_reference_read_whole_once_filled_from_their_runs_rows() -> None:
    done = Completed("It is noon.", "resolved", ("max_steps_near",))
    usage = {"input_tokens": 140, "output_tokens": 12, "cache_read_input_tokens": 0}
    whole = [part_added(ANSWER), run_completed(done, usage)]
    stored = [_logged(stored_by_reference(e, {ANSWER.index}), i) for i, e in enumerate(whole)]
    assert [(e.payload, e.format) for e in stored] == [
        ({"partIndex": 4}, formats.BY_REFERENCE),
        ({"taskOutcome": "resolved", "warnings": ["max_steps_near"]}, formats.BY_REFERENCE),
    ]
    assert formats.referenced_parts(stored) == [4]
    # The part as its row stands now: superseded since, it reads as it was when announced.
    row = replace(ANSWER, superseded=True)
    filled = [
        formats.fill(e, result_text="It is noon.", usage=usage, parts={4: row}) for e in stored
    ]
    assert [e.payload for e in filled] == [e.payload for e in whole]
    event = event_to_proto("run_1", 1, filled[1].type, filled[1].payload, NOW, format=3)
    assert event.run_completed.result_text == "It is noon."
    assert event.run_completed.usage.input_tokens == 140


def test_only_what_a_row_of_the_same_write_holds_as_it_was_is_stored_by_reference() -> None:
    streaming = replace(ANSWER, final=False)
    superseded = replace(ANSWER, superseded=True)
    for event, written in (
        (part_added(streaming), {4}),  # its row changes as it streams on
        (part_updated(superseded), {4}),
        (part_added(ANSWER), {3}),  # its row is not written with it
        (run_queued(0, "admitted"), {4}),
    ):
        kept = stored_by_reference(event, written)
        assert kept == event
        logged = _logged(kept, 1)
        assert logged.format == formats.CURRENT
        assert formats.fill(logged, result_text="", usage={}, parts={}) is logged


def test_an_event_stored_by_reference_read_without_its_rows_is_this_releases_mistake() -> None:
    stored = stored_by_reference(run_completed(Completed("answer"), {}), set()).payload
    with pytest.raises(RuntimeError, match="without the rows it refers to"):
        event_to_proto("run_1", 9, "run.completed", stored, NOW, format=formats.BY_REFERENCE)


TURN = ModelTurn("claude-sonnet-4-5", input_tokens=488, output_tokens=44, cost_micros=1416)


def test_a_usage_updated_is_stored_without_the_turn_its_row_keeps_and_read_whole() -> None:
    whole = usage_updated(TURN, {"input_tokens": 900, "output_tokens": 60, "cost_micros": 2300})
    stored = _logged(stored_by_reference(whole, set(), turn=TURN), 7)
    assert stored.payload == {"total": whole.payload["total"]}
    # A format of its own: the release before this one reads 3, and would take it as whole.
    assert stored.format == formats.USAGE_BY_REFERENCE > formats.BY_REFERENCE
    assert formats.referenced_turns([stored]) == [7] and formats.referenced_parts([stored]) == []
    filled = formats.fill(stored, result_text=None, usage={}, parts={}, turns={7: TURN})
    assert filled.payload == whole.payload
    event = event_to_proto("run_1", 7, filled.type, filled.payload, NOW, format=stored.format)
    assert (event.usage_updated.turn.cost_micros, event.usage_updated.total.input_tokens) == (
        1416,
        900,
    )
    with pytest.raises(RuntimeError, match="without the rows it refers to"):
        event_to_proto("run_1", 7, stored.type, stored.payload, NOW, format=stored.format)


def test_a_usage_updated_is_whole_unless_it_carries_exactly_the_turn_its_row_keeps() -> None:
    # Through the wire's JSON, a worker's counts arrive as the strings of int64s: the same turn.
    wired = Event(
        EventType.USAGE_UPDATED,
        {
            "turn": {
                "model": TURN.model,
                "inputTokens": "488",
                "outputTokens": "44",
                "costMicros": "1416",
            },
            "total": {"inputTokens": "488"},
        },
    )
    assert stored_by_reference(wired, set(), turn=TURN).payload == {"total": {"inputTokens": "488"}}
    for event, turn in (
        (usage_updated(TURN, {}), None),  # no row of the same write names it
        (usage_updated(replace(TURN, cost_micros=0), {}), TURN),  # priced otherwise than its row
        (usage_updated(TURN, {}), replace(TURN, model="claude-haiku-4-5")),
        (Event(EventType.USAGE_UPDATED, {"turn": {**wired.payload["turn"], "extra": 1}}), TURN),
    ):
        kept = stored_by_reference(event, set(), turn=turn)
        assert kept == event and _logged(kept, 1).format == formats.CURRENT
