"""Context building: the conversation so far, as Messages API input.

History parts (earlier runs of the session, then this run's own) become alternating user and
assistant messages. A part a later attempt superseded (its attempt was cut off before the model's
turn ended) is kept for audit but never sent to the model; tool results always follow their calls
at the start of the next user message, as the API requires.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tether.domain import AgentConfig, Part, Role, Text, Thinking, ToolCall, ToolResult


def system_param(config: AgentConfig) -> list[dict[str, Any]]:
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


def _block(part: Part) -> tuple[str, dict[str, Any]] | None:
    """(role, content block) of a part, or None when the model must not see it."""
    if part.superseded:
        return None  # the orchestrator marked it: this attempt regenerates the turn it was in
    content = part.content
    if isinstance(content, Text):
        if part.role == Role.ASSISTANT and not part.final:
            return None  # unfinished and stored before superseding existed
        role = "user" if part.role == Role.USER else "assistant"
        return role, {"type": "text", "text": content.text}
    if isinstance(content, Thinking):
        if not part.final or not content.signature:
            return None
        return "assistant", {
            "type": "thinking",
            "thinking": content.thinking,
            "signature": content.signature,
        }
    if isinstance(content, ToolCall):
        if not part.final:
            return None  # its input never arrived whole
        return "assistant", {
            "type": "tool_use",
            "id": content.tool_call_id,
            "name": content.name,
            "input": dict(content.input),
        }
    if isinstance(content, ToolResult):
        block: dict[str, Any] = {
            "type": "tool_result",
            "tool_use_id": content.tool_call_id,
            "content": content.content,
        }
        if content.is_error:
            block["is_error"] = True
        return "user", block
    return None


def build_messages(
    prior: Sequence[Part], input_text: str, own: Sequence[Part]
) -> list[dict[str, Any]]:
    """Messages for the next model turn: earlier runs, this run's input, this run's parts."""
    parts = [*prior, Part(-1, Role.USER, Text(input_text), final=True), *own]
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
