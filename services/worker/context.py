"""Context building: the conversation so far, as Messages API input.

History parts (earlier runs of the session, then this run's own) become alternating user and
assistant messages. A part a later attempt superseded (its attempt was cut off before the model's
turn ended) is kept for audit but never sent to the model; tool results always follow their calls
at the start of the next user message, as the API requires.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from google.protobuf import json_format

from tether.v1 import common_pb2, orchestrator_pb2


def system_param(config: orchestrator_pb2.AgentConfig) -> list[dict[str, Any]]:
    """Structured system blocks, with cache control where configured."""
    blocks: list[dict[str, Any]] = []
    for block in config.system_blocks:
        item: dict[str, Any] = {"type": "text", "text": block.text}
        if block.cache_control:
            item["cache_control"] = {"type": block.cache_control}
        blocks.append(item)
    if not blocks and config.system_prompt:
        blocks.append({"type": "text", "text": config.system_prompt})
    return blocks


def _block(part: common_pb2.Part) -> tuple[str, dict[str, Any]] | None:
    """(role, content block) of a part, or None when the model must not see it."""
    if part.superseded:
        return None  # the orchestrator marked it: this attempt regenerates the turn it was in
    kind = part.WhichOneof("kind")
    if kind == "text":
        if part.role == "assistant" and not part.final:
            return None  # unfinished and stored before superseding existed
        role = "user" if part.role == "user" else "assistant"
        return role, {"type": "text", "text": part.text.text}
    if kind == "thinking":
        if not part.final or not part.thinking.signature:
            return None
        return "assistant", {
            "type": "thinking",
            "thinking": part.thinking.thinking,
            "signature": part.thinking.signature,
        }
    if kind == "tool_call":
        if not part.final or part.tool_call.cut:
            return None  # never whole (`cut`: how parts stored before superseding said so)
        return "assistant", {
            "type": "tool_use",
            "id": part.tool_call.tool_call_id,
            "name": part.tool_call.name,
            "input": json_format.MessageToDict(part.tool_call.input),
        }
    if kind == "tool_result":
        block: dict[str, Any] = {
            "type": "tool_result",
            "tool_use_id": part.tool_result.tool_call_id,
            "content": part.tool_result.content,
        }
        if part.tool_result.is_error:
            block["is_error"] = True
        return "user", block
    return None


def build_messages(
    history: Sequence[common_pb2.Part], prior_count: int, input_text: str
) -> list[dict[str, Any]]:
    """Messages for the next model turn: earlier runs, this run's input, this run's parts."""
    parts = list(history[:prior_count])
    parts.append(
        common_pb2.Part(role="user", final=True, text=common_pb2.TextPart(text=input_text))
    )
    parts.extend(history[prior_count:])
    messages: list[dict[str, Any]] = []
    called: set[str] = set()
    for part in parts:
        made = _block(part)
        if made is None:
            continue
        role, block = made
        if block["type"] == "tool_use":
            called.add(block["id"])
        if block["type"] == "tool_result" and block["tool_use_id"] not in called:
            continue  # its call was dropped (never finished); an orphan result is invalid
        if messages and messages[-1]["role"] == role:
            content = messages[-1]["content"]
            if block["type"] == "tool_result":
                # Results lead the user message that follows their calls.
                position = sum(1 for b in content if b["type"] == "tool_result")
                content.insert(position, block)
            else:
                content.append(block)
        else:
            messages.append({"role": role, "content": [block]})
    return _close_open_calls(messages)


def _close_open_calls(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop tool_use blocks no result answers (the API rejects them mid-conversation)."""
    answered = {
        b["tool_use_id"] for m in messages for b in m["content"] if b["type"] == "tool_result"
    }
    out: list[dict[str, Any]] = []
    for message in messages:
        content = [b for b in message["content"] if b["type"] != "tool_use" or b["id"] in answered]
        if content:
            if out and out[-1]["role"] == message["role"]:
                out[-1]["content"].extend(content)
            else:
                out.append({"role": message["role"], "content": content})
    return out
