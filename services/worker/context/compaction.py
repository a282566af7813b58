"""Compaction: when the next request would exceed the agent's context budget, the session's
older runs are summarised and the summary stands in for them.

The budget counts, before each model call, the input tokens the last model turn reported (the
lease carries the session's last one, with its output; then each turn of the attempt), plus an
estimate of what was added since: four characters of JSON to a token, for this run's new
message, live facts and knowledge when that turn was an earlier run's, else for the parts the
turn wrote and those after them. When no turn is known (none yet, or a summary replaced the
history since), the whole request is estimated. No call is made to count.

Over budget, the oldest earlier runs are summarised (with the previous summary, if any): whole
runs only, so a tool call never leaves its result, and never this run's own turns, so an
unanswered question or a pending approval stays as it is. The newest runs are kept, as many as
fit half the budget with what else the request holds; the rest go. The summary is a model call
(the agent's compaction model, else the run's own) through the attempt's retry policy, counted
against the run's token and cost ceilings; it is stored, with `context.compacted`, as a part of
the run (`StoreSummary`: once per range, before the next model call), the summarised runs' parts
kept. Breakpoint 2 moves once, to the end of the kept runs, and stays there.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.worker.context.builder import ContextBuilder, EarlierRun, summary_text
from services.worker.context.messages import render_messages
from tether.domain import Part, PartKind, Role, Summary, Text, Thinking, ToolCall, ToolResult

CHARS_PER_TOKEN = 4
SUMMARY_SYSTEM = (
    "You keep the memory of a long conversation between a user and an assistant. You write "
    "summaries the assistant reads instead of the conversation itself."
)
# The summary request's last block: what the model server's script key of such a request is.
SUMMARY_INSTRUCTION = (
    "Summarise the conversation above for the assistant's own later use: who the user is, what "
    "was asked and decided, what tools returned that still matters, and what is still open. "
    "Keep names, numbers and commitments exactly. Write plain prose, no preamble."
)
_MODEL_OUTPUT = frozenset({PartKind.TEXT, PartKind.THINKING, PartKind.TOOL_CALL})


def estimate_tokens(value: Any) -> int:
    """A block's tokens, estimated: four characters of its JSON to a token."""
    return max(1, math.ceil(len(json.dumps(value, sort_keys=True)) / CHARS_PER_TOKEN))


def _plain(block: Any) -> Any:
    if isinstance(block, dict) and "cache_control" in block:
        return {k: v for k, v in block.items() if k != "cache_control"}
    return block


def request_tokens(request: dict[str, Any]) -> int:
    """A whole request's input tokens, estimated block by block."""
    blocks = [*request.get("tools", ()), *request.get("system", ())]
    blocks += [b for m in request["messages"] for b in m["content"]]
    return sum(estimate_tokens(_plain(b)) for b in blocks)


def parts_tokens(parts: Sequence[Part]) -> int:
    """The estimated tokens of `parts` as they are sent."""
    messages = render_messages([p for p in parts if not isinstance(p.content, Summary)])
    return sum(estimate_tokens(_plain(b)) for m in messages for b in m["content"])


class Budget:
    """The estimate of the next request's input tokens (see the module docstring)."""

    def __init__(self, last_turn_tokens: int, last_turn_own: bool, own: Sequence[Part]) -> None:
        self._reported = last_turn_tokens
        # Parts from this index on were added after the reported turn; None: the turn was an
        # earlier run's, so this run's new message and context came after it too.
        self._since: int | None = None
        if last_turn_own:
            output = [p.index for p in own if p.kind in _MODEL_OUTPUT and p.role == Role.ASSISTANT]
            self._since = (max(output) + 1) if output else 0

    def estimate(
        self, context: ContextBuilder, own: Sequence[Part], request: dict[str, Any]
    ) -> int:
        """The next request's input tokens."""
        if not self._reported:
            return request_tokens(request)
        if self._since is None:
            lead = sum(estimate_tokens(b) for b in context.lead["content"])
            return self._reported + lead + parts_tokens(own)
        return self._reported + parts_tokens([p for p in own if p.index >= self._since])

    def turned(self, usage: dict[str, int], first_index: int) -> None:
        """A model turn of this attempt reported `usage`; its output is the parts from
        `first_index` on (estimated as the blocks they are sent as, which the output count
        undercounts), and what follows them."""
        self._reported = sum(
            usage.get(k, 0)
            for k in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
        )
        self._since = first_index

    def forget(self) -> None:
        """The history changed under the reported turn (a compaction): estimate it whole."""
        self._reported = 0


@dataclass(frozen=True)
class Plan:
    """Which earlier runs a compaction summarises (oldest first) and which it keeps."""

    compact: tuple[EarlierRun, ...]
    keep: tuple[EarlierRun, ...]


def plan(earlier: Sequence[EarlierRun], *, keep_tokens: int) -> Plan | None:
    """Keep the newest whole runs that fit `keep_tokens`; summarise the others. None when there
    is nothing older to summarise."""
    kept: list[EarlierRun] = []
    total = 0
    for run in reversed(earlier):
        cost = parts_tokens(run.parts)
        if total + cost > keep_tokens:
            break
        kept.insert(0, run)
        total += cost
    compact = tuple(earlier[: len(earlier) - len(kept)])
    return Plan(compact, tuple(kept)) if compact else None


def transcript_text(previous: Summary | None, runs: Sequence[EarlierRun]) -> str:
    """The runs to summarise as plain text, after the summary they extend."""
    lines: list[str] = []
    if previous is not None:
        lines.append(f"<earlier_summary>\n{previous.text}\n</earlier_summary>")
    for run in runs:
        for part in run.parts:
            line = _line(part)
            if line:
                lines.append(line)
    return "\n".join(lines)


def _line(part: Part) -> str:
    content = part.content
    if part.superseded:
        return ""
    if isinstance(content, Text):
        return f"[{'user' if part.role == Role.USER else 'assistant'}] {content.text}"
    if isinstance(content, ToolCall):
        arguments = json.dumps(dict(content.input), sort_keys=True)
        return f"[assistant called {content.name}] {arguments}"
    if isinstance(content, ToolResult):
        failed = " (failed)" if content.is_error else ""
        return f"[tool result{failed}] {content.content}"
    if isinstance(content, Thinking):
        return ""
    return ""


def summary_request(model: str, max_tokens: int, text: str) -> dict[str, Any]:
    """The model call that writes a summary."""
    return {
        "model": model,
        "max_tokens": max_tokens,
        "system": [{"type": "text", "text": SUMMARY_SYSTEM}],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": text or "(nothing yet)"},
                    {"type": "text", "text": SUMMARY_INSTRUCTION},
                ],
            }
        ],
    }


def summary_max_tokens(budget_tokens: int) -> int:
    """How long a summary may be: an eighth of the budget, between 256 and 4,096 tokens."""
    return max(256, min(budget_tokens // 8, 4096))


def summarised(
    previous: Summary | None,
    chosen: Plan,
    text: str,
    *,
    tokens_before: int,
    history_before: int,
) -> Summary:
    """The summary of `chosen.compact` (and `previous`), with the request's tokens before and
    after (`history_before`: what the summary and the earlier runs weighed before)."""
    runs = chosen.compact
    first = previous.from_run_id if previous is not None else runs[0].run_id
    prior_runs = previous.runs if previous is not None else 0
    prior_parts = previous.parts if previous is not None else 0
    draft = Summary(
        text,
        first,
        runs[-1].run_id,
        runs=prior_runs + len(runs),
        parts=prior_parts + sum(len(r.parts) for r in runs),
    )
    history_after = estimate_tokens({"type": "text", "text": summary_text(draft)}) + sum(
        parts_tokens(r.parts) for r in chosen.keep
    )
    return Summary(
        draft.text,
        draft.from_run_id,
        draft.through_run_id,
        draft.runs,
        draft.parts,
        tokens_before=tokens_before,
        tokens_after=tokens_before - history_before + history_after,
    )


def history_tokens(context: ContextBuilder) -> int:
    """What the summary and the earlier runs weigh in the request."""
    summary = context.summary
    weight = sum(parts_tokens(r.parts) for r in context.earlier)
    if summary is not None:
        weight += estimate_tokens({"type": "text", "text": summary_text(summary)})
    return weight
