"""Parts as Messages API messages.

History parts (earlier runs of the session, then this run's own) become alternating user and
assistant messages. A part a later attempt superseded (its attempt was cut off before the model's
turn ended) is kept for audit but never sent to the model; tool results always follow their calls
at the start of the next user message, as the API requires. Which calls go is the domain's rule
(`tether.domain.rules`): a call whose input never arrived whole is not sent, nor is a dangling
one (the API refuses a call no result answers). A summary part is not a turn: the builder sends
it in place of the runs it covers.

A call's input is sent with its keys sorted: it reaches the worker streamed in the model's order
or read back from storage in another, and the request's bytes must not depend on which, or the
prompt cache would miss on a resumed attempt.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tether.domain import (
    Part,
    Role,
    Text,
    Thinking,
    ToolCall,
    ToolResult,
    dangling_tool_calls,
    is_whole_call,
)

Message = dict[str, Any]


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
            "input": canonical(content.input),
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


def canonical(value: Any) -> Any:
    """JSON data with every object's keys in sorted order (the same bytes however it arrived)."""
    return json.loads(json.dumps(value, sort_keys=True))


def render_messages(parts: Sequence[Part]) -> list[Message]:
    """`parts` (one stretch of history: answers follow their calls within it) as messages."""
    dangling = {
        call.content.tool_call_id
        for call in dangling_tool_calls(parts)
        if isinstance(call.content, ToolCall)
    }
    messages: list[Message] = []
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


def build_messages(prior: Sequence[Part], input_text: str, own: Sequence[Part]) -> list[Message]:
    """Messages for the next model turn: earlier runs, this run's input, this run's parts."""
    return render_messages([*prior, Part(-1, Role.USER, Text(input_text), final=True), *own])


def join(*stretches: Sequence[Message]) -> list[Message]:
    """The messages of each stretch in order, one after another, neighbours of one role merged
    into one message (roles must alternate). The list is new; a message no neighbour merged
    into is the stretch's own (shared, never copied: a long history's messages are many), a
    merged one new. Never change what it returns: copy first."""
    out: list[Message] = []
    merged = False  # whether out[-1] is a message of join's own
    for stretch in stretches:
        for message in stretch:
            if out and out[-1]["role"] == message["role"]:
                if not merged:
                    out[-1] = {"role": out[-1]["role"], "content": list(out[-1]["content"])}
                    merged = True
                out[-1]["content"].extend(message["content"])
            else:
                out.append(message)
                merged = False
    return out


def _without_calls(messages: list[Message], call_ids: set[str]) -> list[Message]:
    """The messages without the tool_use blocks of `call_ids`; a message left empty goes, and
    the neighbours it parted merge (roles must alternate)."""
    if not call_ids:
        return messages  # nothing to take out (nearly always): not copied, a lease's history long
    out: list[Message] = []
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
