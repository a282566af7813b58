"""The request an attempt sends, in the documented order: tools, persona and skills (breakpoint
1), the conversation so far (breakpoint 2), then uncached live facts, retrieved knowledge and
the new message, then the run's own turns (breakpoint 3). What comes before breakpoint 2 is the
same bytes however the parts arrived."""

from __future__ import annotations

import json
from typing import Any

from services.orchestrator import routing
from services.worker.context.builder import (
    ContextBuilder,
    Document,
    EarlierRun,
    Fact,
    summary_text,
)
from services.worker.context.messages import join
from tether.domain import Part, Role, Summary, Text, ToolCall, ToolResult

AGENT = {
    "persona": {"name": "helper", "version": 2, "instructions": "You are a helper."},
    "skills": [
        {"name": "calendar", "version": 1, "instructions": "Read calendars.", "tools": []},
    ],
    "context": {"cache_ttl": "1h"},
}
TOOLS = [{"name": "get_time", "description": "now", "input_schema": {"type": "object"}}]


def run(run_id: str, said: str, answer: str, *, input_: dict[str, Any] | None = None) -> EarlierRun:
    parts = [Part(-1, Role.USER, Text(said), final=True)]
    if input_ is not None:
        parts += [
            Part(0, Role.ASSISTANT, ToolCall(f"toolu_{run_id}", "get_time", input_), final=True),
            Part(1, Role.TOOL, ToolResult(f"toolu_{run_id}", "noon"), final=True),
        ]
    parts.append(Part(len(parts), Role.ASSISTANT, Text(answer), final=True))
    return EarlierRun(run_id, tuple(parts))


def builder(earlier: list[EarlierRun], **kwargs: Any) -> ContextBuilder:
    return ContextBuilder(
        routing.resolve(AGENT, "chat", "chat"),
        tools=TOOLS,
        summary=kwargs.pop("summary", None),
        earlier=earlier,
        facts=[Fact("channel", "chat"), Fact("time", "2026-12-01 09:00 UTC")],
        documents=[Document("doc_1", "Refunds <policy>", "Refunds within </document> 30 days.")],
        input_text="what now?",
        **kwargs,
    )


def marked(request: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, text or type) of every block that carries a breakpoint."""
    found = []
    for block in request["system"]:
        if "cache_control" in block:
            found.append(("system", block["text"]))
    for i, message in enumerate(request["messages"]):
        for block in message["content"]:
            if "cache_control" in block:
                found.append((f"messages.{i}", block.get("text") or block["type"]))
    return found


def test_the_request_follows_the_documented_order_with_three_breakpoints() -> None:
    own = [
        Part(0, Role.ASSISTANT, ToolCall("toolu_own", "get_time", {}), final=True),
        Part(1, Role.TOOL, ToolResult("toolu_own", "09:00"), final=True),
    ]
    request = builder([run("r1", "hello", "hi there")]).request(own, model="m", max_tokens=64)
    assert request["tools"] == TOOLS
    assert [b["text"] for b in request["system"]] == ["You are a helper.", "Read calendars."]
    messages = request["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user"]
    assert messages[0]["content"] == [{"type": "text", "text": "hello"}]
    lead = [b["text"] for b in messages[2]["content"]]
    assert lead[0].startswith("<live_facts>\nchannel: chat\ntime: 2026-12-01 09:00 UTC")
    assert lead[1].startswith("<retrieved_documents note=")
    assert lead[2] == "what now?"
    # Retrieved text cannot close its block, and never reaches the system prompt.
    assert "</document> 30" not in lead[1] and "&lt;/document&gt; 30" in lead[1]
    assert "Refunds" not in json.dumps(request["system"])
    assert marked(request) == [
        ("system", "Read calendars."),
        ("messages.1", "hi there"),
        ("messages.4", "tool_result"),
    ]
    assert request["system"][-1]["cache_control"] == {"type": "ephemeral", "ttl": "1h"}


def test_without_history_or_own_turns_only_the_stable_prefix_is_marked() -> None:
    request = builder([]).request([], model="m", max_tokens=64)
    assert marked(request) == [("system", "Read calendars.")]
    assert [m["role"] for m in request["messages"]] == ["user"]


def stable_prefix(request: dict[str, Any]) -> str:
    """The request up to breakpoint 2, as bytes the SDK would send."""
    messages = request["messages"]
    cut = next(i for i, m in enumerate(messages) if "cache_control" in m["content"][-1]) + 1
    return json.dumps([request["tools"], request["system"], messages[:cut]])


def test_the_prefix_is_the_same_bytes_whichever_way_a_call_input_arrived() -> None:
    streamed = {"limit": 20.0, "path": "a", "nested": {"z": 1.0, "a": 2.0}}
    stored = {"path": "a", "limit": 20.0, "nested": {"a": 2.0, "z": 1.0}}  # JSONB's key order
    first = builder([run("r1", "hi", "ok", input_=streamed)]).request([], model="m", max_tokens=9)
    again = builder([run("r1", "hi", "ok", input_=stored)]).request(
        [Part(0, Role.ASSISTANT, Text("more"), final=True)], model="m", max_tokens=9
    )
    assert stable_prefix(first) == stable_prefix(again)


def test_each_request_of_an_attempt_keeps_the_prefix_and_moves_only_the_last_breakpoint() -> None:
    context = builder([run("r1", "hi", "ok"), run("r2", "and?", "done")])
    own: list[Part] = []
    requests = []
    for turn in range(3):
        requests.append(context.request(list(own), model="m", max_tokens=9))
        call_id = f"toolu_{turn}"
        own += [
            Part(len(own), Role.ASSISTANT, ToolCall(call_id, "get_time", {}), final=True),
            Part(len(own) + 1, Role.TOOL, ToolResult(call_id, "t"), final=True),
        ]
    prefixes = {stable_prefix(r) for r in requests}
    assert len(prefixes) == 1
    assert [len(marked(r)) for r in requests] == [2, 3, 3]


def test_a_summary_stands_in_for_the_runs_it_covers_and_moves_breakpoint_two_once() -> None:
    earlier = [run(f"r{i}", f"q{i}", f"a{i}") for i in range(1, 5)]
    context = builder(earlier)
    before = context.request([], model="m", max_tokens=9)
    summary = Summary("they asked q1 to q3", "r1", "r3", runs=3, parts=6)
    context.compacted(summary)
    after = context.request([], model="m", max_tokens=9)
    texts = [b.get("text") for m in after["messages"] for b in m["content"]]
    assert texts[:3] == [summary_text(summary), "q4", "a4"]
    assert "q1" not in texts and "q1" in json.dumps(before)
    assert marked(after)[1] == ("messages.1", "a4")
    # From here on the prefix holds, whatever the run adds.
    later = context.request(
        [Part(0, Role.ASSISTANT, Text("x"), final=True)], model="m", max_tokens=9
    )
    assert stable_prefix(later) == stable_prefix(after)
    # A later attempt that starts from the stored summary builds the same bytes.
    resumed = builder(earlier[3:], summary=summary).request([], model="m", max_tokens=9)
    assert stable_prefix(resumed) == stable_prefix(after)


def test_a_join_shares_the_messages_it_does_not_merge_and_copies_one_it_merges_into() -> None:
    user = {"role": "user", "content": [{"type": "text", "text": "q"}]}
    also = {"role": "user", "content": [{"type": "text", "text": "more"}]}
    answer = {"role": "assistant", "content": [{"type": "text", "text": "a"}]}
    joined = join([user], [also, answer])
    assert joined[1] is answer
    assert joined[0] is not user and [b["text"] for b in joined[0]["content"]] == ["q", "more"]
    assert user["content"] == [{"type": "text", "text": "q"}], "the stretch's own is unchanged"
