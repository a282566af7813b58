"""Compaction's rules: whole runs are summarised, oldest first, keeping the newest that fit; the
budget starts from the last reported turn and estimates only what came after it."""

from __future__ import annotations

from services.orchestrator import routing
from services.worker.context.builder import ContextBuilder, EarlierRun, Fact
from services.worker.context.compaction import (
    Budget,
    parts_tokens,
    plan,
    request_tokens,
    summarised,
    summary_request,
    transcript_text,
)
from tether.domain import Part, Role, Summary, Text, ToolCall, ToolResult


def run(run_id: str, *, tool: bool = False, words: int = 20) -> EarlierRun:
    parts = [Part(-1, Role.USER, Text(f"question of {run_id} " + "w " * words), final=True)]
    if tool:
        parts += [
            Part(0, Role.ASSISTANT, ToolCall(f"toolu_{run_id}", "get_time", {}), final=True),
            Part(1, Role.TOOL, ToolResult(f"toolu_{run_id}", "noon"), final=True),
        ]
    parts.append(Part(len(parts), Role.ASSISTANT, Text(f"answer of {run_id}"), final=True))
    return EarlierRun(run_id, tuple(parts))


def test_the_newest_whole_runs_that_fit_are_kept_and_the_rest_summarised() -> None:
    earlier = [run(f"r{i}", tool=i % 2 == 0) for i in range(6)]
    two = parts_tokens(earlier[-1].parts) + parts_tokens(earlier[-2].parts)
    chosen = plan(earlier, keep_tokens=two)
    assert chosen is not None
    assert [r.run_id for r in chosen.compact] == ["r0", "r1", "r2", "r3"]
    assert [r.run_id for r in chosen.keep] == ["r4", "r5"]
    # A run goes whole: its tool call never leaves its result behind.
    for kept in chosen.keep:
        calls = {p.content.tool_call_id for p in kept.parts if isinstance(p.content, ToolCall)}
        results = {p.content.tool_call_id for p in kept.parts if isinstance(p.content, ToolResult)}
        assert calls == results
    assert plan(earlier, keep_tokens=two - 1) is not None
    assert [r.run_id for r in plan(earlier, keep_tokens=two - 1).keep] == ["r5"]  # type: ignore[union-attr]
    assert plan(earlier, keep_tokens=10**9) is None, "nothing older to summarise"
    assert [r.run_id for r in plan(earlier, keep_tokens=0).compact] == [  # type: ignore[union-attr]
        "r0",
        "r1",
        "r2",
        "r3",
        "r4",
        "r5",
    ]


def test_a_summary_extends_the_previous_one_and_counts_what_it_replaced() -> None:
    previous = Summary("met on Monday", "r0", "r2", runs=3, parts=9)
    earlier = [run("r3"), run("r4", tool=True), run("r5")]
    chosen = plan(earlier, keep_tokens=parts_tokens(earlier[-1].parts))
    assert chosen is not None
    text = transcript_text(previous, chosen.compact)
    assert text.startswith("<earlier_summary>\nmet on Monday\n</earlier_summary>")
    assert "[assistant called get_time] {}" in text and "[tool result] noon" in text
    summary = summarised(
        previous, chosen, "they met; it is noon", tokens_before=5000, history_before=1200
    )
    assert (summary.from_run_id, summary.through_run_id) == ("r0", "r4")
    assert (summary.runs, summary.parts) == (5, 9 + 2 + 4)
    assert summary.tokens_before == 5000 and summary.tokens_after < 5000
    request = summary_request("m", 256, text)
    assert request["messages"][0]["content"][-1]["text"].startswith("Summarise the conversation")


def builder(earlier: list[EarlierRun]) -> ContextBuilder:
    return ContextBuilder(
        routing.resolve({}, "chat", "chat"),
        tools=[],
        summary=None,
        earlier=earlier,
        facts=[Fact("time", "noon")],
        input_text="and now?",
    )


def test_the_budget_starts_from_the_reported_turn_and_adds_what_came_since() -> None:
    context = builder([run("r1")])
    own = [
        Part(0, Role.ASSISTANT, ToolCall("toolu_a", "get_time", {}), final=True),
        Part(1, Role.TOOL, ToolResult("toolu_a", "noon " * 50), final=True),
    ]
    request = context.request(own, model="m", max_tokens=9)
    # Unknown: the whole request.
    assert Budget(0, False, own).estimate(context, own, request) == request_tokens(request)
    # The previous run's last turn: this run's message, context and turns came after it.
    lead = Budget(1000, False, own).estimate(context, own, request)
    assert lead > 1000 + parts_tokens(own)
    # This run's own turn (a resumed attempt): only the parts after its output.
    resumed = Budget(1000, True, own).estimate(context, own, request)
    assert resumed == 1000 + parts_tokens(own[1:])
    # A turn of this attempt.
    budget = Budget(0, False, own)
    usage = {"input_tokens": 10, "cache_read_input_tokens": 900, "output_tokens": 5}
    budget.turned(usage, 0)  # the turn wrote the call: it and the result came after its input
    assert budget.estimate(context, own, request) == 910 + parts_tokens(own)
    budget.forget()
    assert budget.estimate(context, own, request) == request_tokens(request)
