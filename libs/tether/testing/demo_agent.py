"""The demo agent: a deterministic stand-in for Claude when no API key (and no script) is given.

It reads the conversation the way a tool-using model would, so `make run` exercises the whole
tool loop: a user asks, the agent answers in text and maybe calls a tool, the runtime returns
the tool result, the agent summarises it. It only ever calls tools the request offers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from tether.testing.model_script import (
    MessageTurn,
    TextTurn,
    ToolUseTurn,
    message_text,
    newest_text,
)

EXCERPT_LIMIT = 80
"""How much of the user's text the answer quotes back; enough to recognise, short to read."""

RESULT_LIMIT = 300
"""How much of each tool result the summary quotes."""

_PUBLISH = re.compile(r"\bpublish\b[\s:,\-]*", re.IGNORECASE)
_ASK_ME = re.compile(r"\bask me\b", re.IGNORECASE)
_CALENDAR = re.compile(r"\bcalendar\b", re.IGNORECASE)
_TIME = re.compile(r"\b(time|clock)\b", re.IGNORECASE)
_ORDER = re.compile(r"\border\s+([A-Za-z]-?\d+)", re.IGNORECASE)
_CANCEL = re.compile(r"\bcancel\b", re.IGNORECASE)


def demo_turn(body: Mapping[str, Any]) -> MessageTurn:
    """The demo agent's answer to one `POST /v1/messages` body."""
    messages: Sequence[Any] = body.get("messages") or ()
    last = messages[-1] if messages and isinstance(messages[-1], Mapping) else {}
    if last.get("role") != "user":
        return TextTurn("I have nothing new to add.")
    results = _tool_results(last)
    if results:
        return TextTurn(_summarise(results, _tool_names(messages)))
    text = newest_text(last.get("content")).strip()
    offered = {
        str(tool.get("name")) for tool in body.get("tools") or () if isinstance(tool, Mapping)
    }
    call = _choose_tool(text, offered)
    if call is None:
        return TextTurn(_answer(text))
    name, tool_input = call
    return ToolUseTurn(
        name=name,
        input=tool_input,
        text=f'You said: "{_excerpt(text)}". I will use {name} for that, then report back.',
    )


def _choose_tool(text: str, offered: set[str]) -> tuple[str, dict[str, Any]] | None:
    """First matching intent whose tool is offered; the order makes "publish the time" publish."""
    publish = _PUBLISH.search(text)
    if publish and "publish_post" in offered:
        rest = text[publish.end() :].strip() or text
        return "publish_post", {"text": rest}
    if _ASK_ME.search(text) and "ask_questions" in offered:
        question = {
            "key": "choice",
            "prompt": f'Before I go on with "{_excerpt(text)}": which option should I take?',
            "options": ["Option A", "Option B"],
            "multiple": False,
            "allow_other": True,
        }
        return "ask_questions", {"questions": [question]}
    order = _ORDER.search(text)
    if order:
        # An MCP order desk's tools, whatever its server is called (`<server>__lookup_order`).
        wanted = "__cancel_order" if _CANCEL.search(text) else "__lookup_order"
        tool = next((n for n in sorted(offered) if n.endswith(wanted)), None)
        if tool is not None:
            return tool, {"order_id": order.group(1).upper()}
    if _CALENDAR.search(text) and "calendar_list_events" in offered:
        return "calendar_list_events", {}
    if _TIME.search(text) and "get_time" in offered:
        return "get_time", {}
    return None


def _answer(text: str) -> str:
    if not text:
        return "I did not receive any text. Send me a message and I will answer it."
    return (
        f'You said: "{_excerpt(text)}". I am the Tether demo agent, a deterministic stand-in '
        "for a real model, so I answer the same way every time. Set ANTHROPIC_API_KEY to talk "
        "to Claude instead."
    )


def _tool_results(message: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    content = message.get("content")
    if not isinstance(content, list):
        return []
    return [b for b in content if isinstance(b, Mapping) and b.get("type") == "tool_result"]


def _tool_names(messages: Sequence[Any]) -> dict[str, str]:
    """tool_use id → tool name, from every assistant turn so far."""
    names: dict[str, str] = {}
    for message in messages:
        if not isinstance(message, Mapping) or message.get("role") != "assistant":
            continue
        content = message.get("content")
        for block in content if isinstance(content, list) else ():
            if isinstance(block, Mapping) and block.get("type") == "tool_use":
                names[str(block.get("id"))] = str(block.get("name"))
    return names


def _summarise(results: Sequence[Mapping[str, Any]], names: Mapping[str, str]) -> str:
    lines = ["Here is what the tools returned."]
    for result in results:
        name = names.get(str(result.get("tool_use_id")), "the tool")
        content = message_text(result.get("content")).strip() or "(no output)"
        if len(content) > RESULT_LIMIT:
            content = content[:RESULT_LIMIT] + "..."
        verb = "failed with" if result.get("is_error") else "returned"
        lines.append(f"{name} {verb}: {content}")
    lines.append("That is everything I needed.")
    return " ".join(lines)


def _excerpt(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= EXCERPT_LIMIT else flat[: EXCERPT_LIMIT - 3] + "..."
