"""What the model is sent: the conversation so far as Messages API input. Only whole, answered
calls go (a cut call never ran, a dangling one has no result and the API refuses it), a result
goes only after its call, and what a later attempt superseded stays out."""

from __future__ import annotations

from typing import Any

from services.worker.context import build_messages
from tether.domain import Part, Text, Thinking, ToolCall, ToolResult


def user(index: int, words: str) -> Part:
    return Part(index, "user", Text(words), True)


def text(index: int, words: str, *, final: bool = True, superseded: bool = False) -> Part:
    return Part(index, "assistant", Text(words), final, superseded)


def call(index: int, call_id: str, *, final: bool = True) -> Part:
    return Part(index, "assistant", ToolCall(call_id, "post", {"q": call_id}), final)


def result(index: int, call_id: str, *, is_error: bool = False) -> Part:
    return Part(index, "tool", ToolResult(call_id, f"out {call_id}", is_error), True)


def use(call_id: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": "post", "input": {"q": call_id}}


def answer(call_id: str, *, is_error: bool = False) -> dict[str, Any]:
    block: dict[str, Any] = {
        "type": "tool_result",
        "tool_use_id": call_id,
        "content": f"out {call_id}",
    }
    if is_error:
        block["is_error"] = True
    return block


def words(said: str) -> dict[str, Any]:
    return {"type": "text", "text": said}


def test_whole_answered_calls_go_with_their_results_leading_the_next_user_message() -> None:
    own = [
        Part(0, "assistant", Thinking("hm", "sig"), True),
        Part(1, "assistant", Thinking("unsigned"), True),
        text(2, "looking"),
        call(3, "toolu_a"),
        call(4, "toolu_b"),
        result(5, "toolu_a"),
        result(6, "toolu_b", is_error=True),
        text(7, "done"),
    ]
    assert build_messages([user(0, "earlier")], "now", own) == [
        {"role": "user", "content": [words("earlier"), words("now")]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hm", "signature": "sig"},
                words("looking"),
                use("toolu_a"),
                use("toolu_b"),
            ],
        },
        {"role": "user", "content": [answer("toolu_a"), answer("toolu_b", is_error=True)]},
        {"role": "assistant", "content": [words("done")]},
    ]


def test_cut_and_dangling_calls_are_not_sent_nor_is_a_result_without_its_call() -> None:
    own = [
        text(0, "two calls"),
        call(1, "toolu_whole"),
        call(2, "toolu_dangling"),  # whole, never answered (its attempt died)
        call(3, "toolu_cut", final=False),  # its input never arrived whole
        result(4, "toolu_whole"),
        result(5, "toolu_cut"),  # answers nothing the model is sent
        text(6, "unfinished", final=False),
        text(7, "regenerated away", superseded=True),
    ]
    assert build_messages([], "go", own) == [
        {"role": "user", "content": [words("go")]},
        {"role": "assistant", "content": [words("two calls"), use("toolu_whole")]},
        {"role": "user", "content": [answer("toolu_whole")]},
    ]


def test_a_message_left_empty_by_a_dangling_call_goes_and_its_neighbours_merge() -> None:
    prior = [user(0, "first"), call(1, "toolu_open")]
    own = [text(0, "answering"), call(1, "toolu_last")]
    assert build_messages(prior, "second", own) == [
        {"role": "user", "content": [words("first"), words("second")]},
        {"role": "assistant", "content": [words("answering")]},
    ]
