"""Context building: the conversation so far, as Messages API input.

History parts (earlier runs of the session, then this run's own) become alternating user and
assistant messages. A part a later attempt superseded (its attempt was cut off before the model's
turn ended) is kept for audit but never sent to the model; tool results always follow their calls
at the start of the next user message, as the API requires. Which calls go is the domain's rule
(`tether.domain.rules`): a call whose input never arrived whole is not sent, nor is a dangling
one (the API refuses a call no result answers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tether.domain import (
    AgentConfig,
    Part,
    Role,
    Text,
    Thinking,
    ToolCall,
    ToolResult,
    dangling_tool_calls,
    is_whole_call,
)


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
        if not is_whole_call(part):
            return None
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
    dangling = {
        call.content.tool_call_id
        for call in dangling_tool_calls(parts)
        if isinstance(call.content, ToolCall)
    }
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
    return _without_calls(messages, dangling)


def _without_calls(messages: list[dict[str, Any]], call_ids: set[str]) -> list[dict[str, Any]]:
    """The messages without the tool_use blocks of `call_ids`; a message left empty goes, and
    the neighbours it parted merge (roles must alternate)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        content = [
            b for b in message["content"] if b["type"] != "tool_use" or b["id"] not in call_ids
        ]
        if content:
            if out and out[-1]["role"] == message["role"]:
                out[-1]["content"].extend(content)
            else:
                out.append({"role": message["role"], "content": content})
    return out
