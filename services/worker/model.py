"""One model turn: stream the Messages API into parts, checkpointing as it goes.

Each block streams into a draft (`services.worker.drafts`) that becomes a part when a checkpoint
takes it or the block ends. Text and thinking arrive as deltas (published live, never persisted
one by one); tool input arrives as partial JSON and is parsed at its block's end. A turn the
stream breaks off is left as it stands: the orchestrator supersedes what the next attempt
regenerates (and a tool call that never arrived whole in any case), so none of it is run or sent
back. A checkpoint is requested at every block boundary and at least every
`checkpoint_interval_s` while streaming (a long part's snapshot rides along only once it has
grown by a quarter: `services.worker.transcript`); it is written behind the stream (see
`CheckpointWriter.checkpoint`), so the stream never waits for the database. A block's end is
checkpointed when the next block starts, or BLOCK_END_GRACE_S later; when the message ends
first, the completion carries an answer block and the tool's checkpoint a tool-call block (one
write, not two).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from anthropic import AsyncAnthropic

from services.worker import sse
from services.worker.drafts import Draft, TextDraft, ThinkingDraft, ToolCallDraft
from services.worker.provider_errors import StreamIncomplete
from services.worker.transcript import Transcript
from tether.domain import ToolCall
from tether.pricing import TOKEN_FIELDS

Checkpoint = Callable[[], None]

# How long a finished block may wait for the message's end before it is checkpointed alone.
BLOCK_END_GRACE_S = 0.05
Delta = Callable[[int, str, int], Awaitable[None]]


@dataclass
class TurnResult:
    """What one model turn produced."""

    stop_reason: str | None
    usage: dict[str, int] = field(default_factory=dict)
    tool_calls: list[ToolCall] = field(default_factory=list)


async def stream_turn(
    client: AsyncAnthropic,
    *,
    request: dict[str, Any],
    transcript: Transcript,
    checkpoint: Checkpoint,
    publish_delta: Delta,
    checkpoint_interval_s: float,
    headers: sse.AnswerHeaders | None = None,
) -> TurnResult:
    """Run one streamed model call, writing its blocks into `transcript` (and the answer's
    rate-limit headers into `headers`, when given)."""
    result = TurnResult(stop_reason=None)
    drafts: dict[int, Draft] = {}  # by the stream's block index
    loop = asyncio.get_running_loop()
    block_ended: asyncio.TimerHandle | None = None

    def checkpoint_ended_block() -> None:
        nonlocal block_ended
        if block_ended is not None:
            block_ended.cancel()
            block_ended = None
            checkpoint()

    try:
        async for event in sse.events(client, request, headers):
            kind = event["type"]
            if kind == "content_block_delta":
                draft = drafts.get(event["index"])
                if draft is not None:
                    await _apply_delta(draft, event["delta"], publish_delta)
                    transcript.touch(draft)
                    if transcript.checkpoint_due(checkpoint_interval_s):
                        checkpoint()
            elif kind == "message_start":
                result.usage = usage_of(event["message"].get("usage"))
            elif kind == "content_block_start":
                checkpoint_ended_block()
                draft = _start_draft(event["content_block"])
                if draft is not None:
                    drafts[event["index"]] = transcript.open(draft)
            elif kind == "content_block_stop":
                draft = drafts.pop(event["index"], None)
                if draft is not None:
                    part = transcript.finish(draft)
                    if isinstance(part.content, ToolCall):
                        result.tool_calls.append(part.content)
                    if block_ended is None:
                        block_ended = loop.call_later(BLOCK_END_GRACE_S, checkpoint_ended_block)
            elif kind == "message_delta":
                result.stop_reason = event["delta"].get("stop_reason")
                result.usage.update({k: v for k, v in usage_of(event.get("usage")).items() if v})
            elif kind == "message_stop" and block_ended:
                # The run's answer goes with the completion; tool calls go with their results
                # or their announcement (Gate._while_announced).
                block_ended.cancel()
                block_ended = None
    finally:
        # The stream broke: what finished is checkpointed now.
        checkpoint_ended_block()
    if result.stop_reason is None:
        # The body ended cleanly without message_stop: nothing was raised, so we must.
        raise StreamIncomplete("the model stream ended before message_stop")
    return result


def usage_of(usage: dict[str, Any] | None) -> dict[str, int]:
    """The token counts of a stream's usage object."""
    out = {}
    for key in TOKEN_FIELDS:
        value = (usage or {}).get(key)
        if value is not None:
            out[key] = int(value)
    return out


def _start_draft(block: dict[str, Any]) -> Draft | None:
    kind = block.get("type")
    if kind == "text":
        return TextDraft(block.get("text") or "")
    if kind == "thinking":
        return ThinkingDraft(block.get("thinking") or "", block.get("signature") or "")
    if kind == "tool_use":
        return ToolCallDraft(block["id"], block["name"], dict(block.get("input") or {}))
    return None  # block kinds this runtime does not model (server tools) are skipped


async def _apply_delta(draft: Draft, delta: dict[str, Any], publish: Delta) -> None:
    kind = delta.get("type")
    if kind == "text_delta" and isinstance(draft, TextDraft):
        text = delta["text"]
        await publish(draft.index, text, draft.extend(text))
    elif kind == "thinking_delta" and isinstance(draft, ThinkingDraft):
        draft.extend(delta["thinking"])
    elif kind == "signature_delta" and isinstance(draft, ThinkingDraft):
        draft.sign(delta["signature"])
    elif kind == "input_json_delta" and isinstance(draft, ToolCallDraft):
        draft.extend(delta["partial_json"])
