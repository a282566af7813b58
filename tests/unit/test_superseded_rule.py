"""Which parts an ending attempt leaves superseded, and how the attempt is settled: the domain's
one rule, which the orchestrator and the worker both call."""

from __future__ import annotations

import pytest

from tether import formats
from tether.domain import (
    ApprovalMarker,
    Interruption,
    Part,
    Text,
    Thinking,
    ToolCall,
    ToolResult,
    close_attempt,
    dangling_tool_calls,
    superseded_on_close,
)
from tether.errors import StoredFormatTooNew


def text(index: int, words: str, *, final: bool = True) -> Part:
    return Part(index, "assistant", Text(words), final)


def call(index: int, call_id: str, *, final: bool = True) -> Part:
    return Part(index, "assistant", ToolCall(call_id, "post"), final)


def result(index: int, call_id: str) -> Part:
    return Part(index, "tool", ToolResult(call_id, "ok"), True)


def indexes(parts: list[Part]) -> list[int]:
    return [p.index for p in parts]


def test_a_regenerated_turn_is_superseded_whole_its_finished_blocks_too() -> None:
    parts = [
        call(0, "a"),
        result(1, "a"),
        Part(2, "assistant", Thinking("hm", "s"), True),
        text(3, "The short answer: "),
        text(4, "yes, bec", final=False),
    ]
    assert indexes(superseded_on_close(parts, regenerated=True)) == [2, 3, 4]


def test_a_terminal_end_keeps_the_last_words_and_supersedes_only_a_cut_call() -> None:
    parts = [text(0, "Let me post it."), call(1, "a", final=False)]
    assert indexes(superseded_on_close(parts, regenerated=False)) == [1]
    assert superseded_on_close([text(0, "Hel", final=False)], regenerated=False) == []


def test_a_turn_holding_a_whole_call_stands_and_its_cut_sibling_goes() -> None:
    parts = [text(0, "Posting both."), call(1, "a"), call(2, "b", final=False)]
    assert indexes(superseded_on_close(parts, regenerated=True)) == [2]


def test_a_turn_ended_by_a_pause_marker_or_a_result_leaves_nothing_to_supersede() -> None:
    marker = Part(2, "assistant", ApprovalMarker("i"), True)
    assert superseded_on_close([text(0, "Asking."), call(1, "a"), marker], regenerated=True) == []
    assert superseded_on_close([call(0, "a"), result(1, "a")], regenerated=True) == []


def test_parts_already_superseded_are_neither_marked_again_nor_part_of_the_turn() -> None:
    earlier = Part(0, "assistant", Text("Hel"), False, superseded=True)
    assert indexes(superseded_on_close([earlier, text(1, "Hello")], regenerated=True)) == [1]
    assert superseded_on_close([earlier], regenerated=True) == []


def stored_call(payload: dict[str, object], format: int) -> Part:
    return formats.read_part(
        index=1,
        role="assistant",
        kind="tool_call",
        payload=payload,
        final=True,
        superseded=False,
        format=format,
        what="part 1 of run r",
    )


def test_a_call_stored_cut_by_earlier_releases_reads_as_superseded_and_never_dangles() -> None:
    legacy = stored_call({"toolCallId": "a", "name": "post", "cut": True}, format=1)
    assert legacy.superseded and legacy.content == ToolCall("a", "post")
    assert dangling_tool_calls([text(0, "Go."), legacy]) == []
    # The turn it cut is regenerated; the call itself is marked already.
    assert indexes(superseded_on_close([text(0, "Go."), legacy], regenerated=True)) == [0]
    assert superseded_on_close([text(0, "Go."), legacy], regenerated=False) == []


def test_cut_is_no_field_of_the_current_format() -> None:
    with pytest.raises(StoredFormatTooNew, match="cut"):
        stored_call({"toolCallId": "a", "name": "post", "cut": True}, format=formats.CURRENT)


def test_closing_announces_each_superseded_part_and_interrupts_only_whole_dangling_calls() -> None:
    parts = [
        call(0, "a"),
        result(1, "a"),
        text(2, "Now b."),
        call(3, "b"),
        call(4, "c", final=False),
    ]
    closing = close_attempt(parts, 2, regenerated=True, interrupted=Interruption.LEASE_LOST)
    assert indexes(closing.superseded) == [4]
    assert [(p.index, p.content) for p in closing.parts] == [
        (5, ToolResult("b", "interrupted: the worker lost its lease", is_error=True))
    ]
    announced, *interrupted = closing.events
    assert (announced.type, dict(announced.payload)) == (
        "part.superseded",
        {"partIndex": 4, "attempt": 2},
    )
    assert [e.type for e in interrupted] == ["part.added", "tool.failed"]
    left = close_attempt(parts, 2, regenerated=True, interrupted=None)
    assert left.parts == [] and [e.type for e in left.events] == ["part.superseded"]
