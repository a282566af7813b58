"""One model turn: stream the Messages API into typed parts, checkpointing as it goes.

Text and thinking arrive as deltas (published live, never persisted one by one); tool input
arrives as partial JSON and is parsed at its block's end. A turn the stream breaks off is left
as it stands: the orchestrator supersedes what the next attempt regenerates (and a tool call
that never arrived whole in any case), so none of it is run or sent back. A checkpoint is
requested at every block boundary and at least every `checkpoint_interval_s` while streaming;
it is written behind the stream (see `CheckpointWriter.checkpoint`), so the stream never waits
for the database. A block's end is checkpointed when the next block starts, or BLOCK_END_GRACE_S
later; when the message ends first, the completion carries an answer block and the tool's
checkpoint a tool-call block (one write, not two).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from anthropic import AsyncAnthropic

from services.worker.provider_errors import StreamIncomplete
from services.worker.transcript import Transcript, struct
from tether.v1 import common_pb2

Checkpoint = Callable[[], None]

# How long a finished block may wait for the message's end before it is checkpointed alone.
BLOCK_END_GRACE_S = 0.05
Delta = Callable[[int, str, int], Awaitable[None]]


@dataclass
class TurnResult:
    """What one model turn produced."""

    stop_reason: str | None
    usage: dict[str, int] = field(default_factory=dict)
    tool_calls: list[common_pb2.Part] = field(default_factory=list)


async def stream_turn(
    client: AsyncAnthropic,
    *,
    request: dict[str, Any],
    transcript: Transcript,
    checkpoint: Checkpoint,
    publish_delta: Delta,
    checkpoint_interval_s: float,
) -> TurnResult:
    """Run one streamed model call, writing its blocks into `transcript`."""
    result = TurnResult(stop_reason=None)
    by_index: dict[int, common_pb2.Part] = {}
    json_buffers: dict[int, str] = {}
    loop = asyncio.get_running_loop()
    block_ended: asyncio.TimerHandle | None = None

    def checkpoint_ended_block() -> None:
        nonlocal block_ended
        if block_ended is not None:
            block_ended.cancel()
            block_ended = None
            checkpoint()

    stream = await client.messages.create(**request, stream=True)
    try:
        async with stream:
            async for event in stream:
                kind = event.type
                if kind == "message_start":
                    result.usage = _usage(event.message.usage)
                elif kind == "content_block_start":
                    checkpoint_ended_block()
                    part = _start_part(event.content_block)
                    if part is not None:
                        by_index[event.index] = transcript.add(part)
                        json_buffers[event.index] = ""
                elif kind == "content_block_delta":
                    part = by_index.get(event.index)
                    if part is not None:
                        await _apply_delta(
                            part, event.delta, json_buffers, event.index, publish_delta
                        )
                        transcript.touch(part, announce=False)
                        if time.monotonic() - transcript.last_flush >= checkpoint_interval_s:
                            checkpoint()
                elif kind == "content_block_stop":
                    part = by_index.get(event.index)
                    if part is not None:
                        _finish_part(part, json_buffers.get(event.index, ""))
                        transcript.touch(part, announce=True)
                        if part.WhichOneof("kind") == "tool_call":
                            result.tool_calls.append(part)
                        if block_ended is None:
                            block_ended = loop.call_later(BLOCK_END_GRACE_S, checkpoint_ended_block)
                elif kind == "message_delta":
                    result.stop_reason = event.delta.stop_reason
                    result.usage.update({k: v for k, v in _usage(event.usage).items() if v})
                if kind == "message_stop" and block_ended:
                    # The run's answer goes with the completion; tool calls go with their
                    # results or their announcement (Gate._while_announced).
                    block_ended.cancel()
                    block_ended = None
    finally:
        # The stream broke: what finished is checkpointed now.
        checkpoint_ended_block()
    if result.stop_reason is None:
        # The body ended cleanly without message_stop: the SDK raises nothing, we must.
        raise StreamIncomplete("the model stream ended before message_stop")
    return result


def _usage(usage: Any) -> dict[str, int]:
    out = {}
    for key in (
        "input_tokens",
        "output_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
    ):
        value = getattr(usage, key, None)
        if value is not None:
            out[key] = int(value)
    return out


def _start_part(block: Any) -> common_pb2.Part | None:
    if block.type == "text":
        return common_pb2.Part(role="assistant", text=common_pb2.TextPart(text=block.text or ""))
    if block.type == "thinking":
        return common_pb2.Part(
            role="assistant",
            thinking=common_pb2.ThinkingPart(
                thinking=block.thinking or "", signature=block.signature or ""
            ),
        )
    if block.type == "tool_use":
        return common_pb2.Part(
            role="assistant",
            tool_call=common_pb2.ToolCallPart(
                tool_call_id=block.id, name=block.name, input=struct(dict(block.input or {}))
            ),
        )
    return None  # block kinds this runtime does not model (server tools) are skipped


async def _apply_delta(
    part: common_pb2.Part, delta: Any, buffers: dict[int, str], index: int, publish: Delta
) -> None:
    if delta.type == "text_delta":
        offset = len(part.text.text)
        part.text.text += delta.text
        await publish(part.index, delta.text, offset)
    elif delta.type == "thinking_delta":
        part.thinking.thinking += delta.thinking
    elif delta.type == "signature_delta":
        part.thinking.signature += delta.signature
    elif delta.type == "input_json_delta":
        buffers[index] += delta.partial_json


def _finish_part(part: common_pb2.Part, json_buffer: str) -> None:
    if part.WhichOneof("kind") == "tool_call" and json_buffer.strip():
        part.tool_call.input.Clear()
        part.tool_call.input.update(json.loads(json_buffer))
    part.final = True
