"""The worker's transcript: drafts that stream into frozen parts, the batches a checkpoint takes,
and the dangling-call rule it borrows from the domain model."""

from __future__ import annotations

import itertools

import pytest

from services.worker.drafts import TextDraft, ThinkingDraft, ToolCallDraft
from services.worker.transcript import SMALL_SNAPSHOT, SNAPSHOT_GROWTH, Transcript
from tether.domain import (
    EventType,
    Interruption,
    ModelTurn,
    Part,
    Role,
    Text,
    Thinking,
    ToolCall,
    ToolResult,
)


def test_a_text_draft_gives_each_chunk_its_offset_and_freezes_as_it_stands() -> None:
    draft = TextDraft("He")
    assert draft.extend("llo") == 2
    assert draft.extend(", world") == 5
    draft.index = 3
    assert draft.freeze(final=False) == Part(3, Role.ASSISTANT, Text("Hello, world"))
    assert draft.extend("!") == 12
    assert draft.freeze(final=True) == Part(3, Role.ASSISTANT, Text("Hello, world!"), final=True)


def test_a_thinking_draft_collects_its_signature_apart() -> None:
    draft = ThinkingDraft()
    draft.extend("Weigh ")
    draft.sign("sig_")
    draft.extend("both.")
    draft.sign("abc")
    assert draft.freeze(final=True).content == Thinking("Weigh both.", "sig_abc")


def test_a_tool_call_draft_parses_its_input_only_once_its_block_ends() -> None:
    draft = ToolCallDraft("toolu_1", "get_time", {})
    for piece in ('{"tz": "UT', 'C", "days"', ": [1, 2]}"):
        draft.extend(piece)
    assert draft.freeze(final=False).content == ToolCall("toolu_1", "get_time", {})
    assert draft.freeze(final=True).content == ToolCall(
        "toolu_1", "get_time", {"tz": "UTC", "days": [1.0, 2.0]}
    )
    broken = ToolCallDraft("toolu_2", "get_time", {})
    broken.extend("[1, 2]")
    with pytest.raises(ValueError, match="no object"):
        broken.freeze(final=True)


def test_a_streaming_part_is_checkpointed_as_it_stands_and_announced_twice() -> None:
    transcript = Transcript([Part(0, Role.ASSISTANT, Text("earlier"), final=True)])
    draft = transcript.open(TextDraft())
    assert draft.index == 1
    draft.extend("Hel")
    transcript.touch(draft)
    batch = transcript.take(1)
    assert batch.number == 1
    assert batch.parts == (Part(1, Role.ASSISTANT, Text("Hel")),)
    assert [e.type for e in batch.events] == [EventType.PART_ADDED]
    assert batch.events[0].payload["part"] == {"index": 1, "role": "assistant", "text": {}}
    assert not transcript.pending

    draft.extend("lo")
    transcript.touch(draft)
    assert transcript.parts[-1] == Part(1, Role.ASSISTANT, Text("Hello"))
    final = transcript.finish(draft)
    assert final == Part(1, Role.ASSISTANT, Text("Hello"), final=True)
    batch = transcript.take(2)
    assert batch.parts == (final,)
    assert [e.type for e in batch.events] == [EventType.PART_UPDATED]
    assert transcript.parts[-1] == final
    assert transcript.final_text(1) == "Hello"


def test_a_block_that_starts_and_ends_between_checkpoints_is_announced_once_whole() -> None:
    transcript = Transcript([])
    first = transcript.open(TextDraft())
    first.extend("Hi")
    transcript.touch(first)
    transcript.add(Role.TOOL, ToolResult("toolu_1", "12:00"))
    second = transcript.open(TextDraft())
    second.extend("there")
    transcript.finish(first)
    transcript.finish(second)
    batch = transcript.take(1)
    assert [(e.type, e.payload["part"]["index"]) for e in batch.events] == [
        (EventType.PART_ADDED, 0),
        (EventType.PART_ADDED, 1),
        (EventType.PART_ADDED, 2),
    ]
    assert batch.events[0].payload["part"] == {
        "index": 0,
        "role": "assistant",
        "text": {"text": "Hi"},
        "final": True,
    }
    # Once its part.added has gone, a part's end is a part.updated.
    third = transcript.open(TextDraft())
    third.extend("more")
    transcript.touch(third)
    assert [e.type for e in transcript.take(2).events] == [EventType.PART_ADDED]
    transcript.finish(third)
    assert [e.type for e in transcript.take(3).events] == [EventType.PART_UPDATED]


def test_a_long_streaming_part_is_carried_again_only_once_it_grew_by_a_quarter() -> None:
    transcript = Transcript([])
    draft = transcript.open(TextDraft())
    sizes = []
    # A part that streams 100 characters between routine checkpoints up to 10,000.
    for _ in range(100):
        draft.extend("x" * 100)
        transcript.touch(draft)
        sizes += [len(p.content.text) for p in transcript.take(len(sizes) + 1).parts]
    short = [s for s in sizes if s < SMALL_SNAPSHOT]
    assert short == list(range(100, SMALL_SNAPSHOT, 100)), "a short part goes every time"
    long = [s for s in sizes if s >= SMALL_SNAPSHOT]
    assert all(b >= a * SNAPSHOT_GROWTH for a, b in itertools.pairwise([short[-1], *long]))
    assert long[-1] > 10_000 / SNAPSHOT_GROWTH, "never more than a quarter behind"
    # The snapshots weigh a few times the part, not its size times the checkpoints (500,000).
    assert sum(sizes) < 7 * 10_000

    # What could wait still goes whole when asked for everything, and at the block's end.
    draft.extend("y")
    transcript.touch(draft)
    assert transcript.pending and not transcript.due
    assert [len(p.content.text) for p in transcript.take(200, whole=True).parts] == [10_001]
    draft.extend("z")
    transcript.touch(draft)
    transcript.finish(draft)
    assert transcript.due
    assert [(p.final, len(p.content.text)) for p in transcript.take(201).parts] == [(True, 10_002)]


def test_a_streaming_tool_call_whose_snapshot_cannot_change_is_carried_once() -> None:
    transcript = Transcript([])
    call = transcript.open(ToolCallDraft("toolu_1", "get_time", {}))
    assert [p.content for p in transcript.take(1).parts] == [ToolCall("toolu_1", "get_time", {})]
    call.extend('{"tz": ')
    transcript.touch(call)
    assert not transcript.due and transcript.take(2).parts == ()
    call.extend('"UTC"}')
    transcript.touch(call)
    transcript.finish(call)
    [final] = transcript.take(3).parts
    assert final.final and final.content == ToolCall("toolu_1", "get_time", {"tz": "UTC"})


def test_a_routine_checkpoint_is_due_after_the_interval_only_with_something_to_carry() -> None:
    transcript = Transcript([])
    draft = transcript.open(TextDraft("x" * SMALL_SNAPSHOT))
    transcript.take(1)
    transcript.last_flush -= 1.0  # the interval (0.5 s here) has passed
    draft.extend("x")
    transcript.touch(draft)
    assert not transcript.checkpoint_due(0.5), "one more character of a long part can wait"
    assert not transcript.checkpoint_due(0.5), "and the interval started again"
    transcript.last_flush -= 1.0
    transcript.record_turn(ModelTurn("claude", 10, 5))
    assert transcript.checkpoint_due(0.5)


def test_whole_parts_take_the_next_index_and_go_once_per_checkpoint() -> None:
    transcript = Transcript([])
    first = transcript.add(Role.TOOL, ToolResult("toolu_1", "12:00"))
    second = transcript.add(Role.TOOL, ToolResult("toolu_2", "13:00"))
    assert (first.index, second.index, first.final) == (0, 1, True)
    assert transcript.take(1).parts == (first, second)
    assert transcript.take(2).parts == ()


def test_close_dangling_closes_only_whole_open_calls_with_the_domain_rule() -> None:
    own = [
        Part(0, Role.ASSISTANT, ToolCall("a", "get_time"), final=True),
        Part(1, Role.TOOL, ToolResult("a", "ok"), final=True),
        Part(2, Role.ASSISTANT, ToolCall("b", "publish_post"), final=True),
        Part(3, Role.ASSISTANT, ToolCall("c", "publish_post"), final=True, superseded=True),
    ]
    transcript = Transcript(own)
    cut = transcript.open(ToolCallDraft("d", "publish_post", {}))  # never whole
    assert [c.tool_call_id for c in transcript.dangling_tool_calls()] == ["b"]
    transcript.close_dangling(Interruption.RUN_FAILED)
    assert transcript.dangling_tool_calls() == []
    batch = transcript.take(1)
    result = Part(5, Role.TOOL, ToolResult("b", "interrupted: the run failed", True), final=True)
    assert batch.parts == (Part(cut.index, Role.ASSISTANT, ToolCall("d", "publish_post")), result)
    failed = batch.events[-1]
    assert failed.type is EventType.TOOL_FAILED
    assert failed.payload["error"] == {
        "code": "tool_interrupted",
        "message": "the run failed",
        "retryable": True,
    }
