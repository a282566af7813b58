"""The Messages API wire format: SSE events, message JSON, error bodies, request checks.

Key order and JSON spacing follow the real API byte for byte (compact separators for event
data, `json.dumps` default spacing inside tool-input fragments), so a scripted turn can
reproduce a recorded stream exactly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tether.testing.model_cache import Accounting
from tether.testing.model_cache import input_tokens_for as input_tokens_for
from tether.testing.model_script import (
    Block,
    MessageTurn,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
    Usage,
)

ERROR_TYPE_BY_STATUS: Mapping[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
"""Status → `error.type` as the real API pairs them (platform.claude.com/docs/en/api/errors)."""

STATUS_BY_ERROR_TYPE: Mapping[str, int] = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "billing_error": 402,
    "permission_error": 403,
    "not_found_error": 404,
    "conflict_error": 409,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}
"""The inverse, used when a mid-stream error is scripted for a non-streaming request."""

DEFAULT_ERROR_MESSAGES: Mapping[str, str] = {
    "invalid_request_error": "Invalid request.",
    "authentication_error": "invalid x-api-key",
    "billing_error": "Your credit balance is too low.",
    "permission_error": "Your API key does not have permission to use the specified resource.",
    "not_found_error": "The requested resource could not be found.",
    "conflict_error": "Conflict.",
    "request_too_large": "Request exceeds the maximum allowed number of bytes.",
    "rate_limit_error": "Number of request tokens has exceeded your per-minute rate limit.",
    "api_error": "Internal server error",
    "timeout_error": "Request timed out",
    "overloaded_error": "Overloaded",
}

TEXT_WORDS_PER_DELTA = 3
"""Default text chunking: a few words per delta gives several deltas for one sentence."""

JSON_CHARS_PER_DELTA = 12
"""Default tool-input chunking: short fragments, so partial-JSON parsing is exercised."""


def error_type_for_status(status: int) -> str:
    """The `error.type` the real API sends with `status`."""
    if status in ERROR_TYPE_BY_STATUS:
        return ERROR_TYPE_BY_STATUS[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(error_type: str, message: str | None, request_id: str) -> dict[str, Any]:
    """`{"type":"error","error":{...},"request_id":...}`, the HTTP error body shape."""
    text = message if message is not None else DEFAULT_ERROR_MESSAGES.get(error_type, "Error")
    return {
        "type": "error",
        "error": {"type": error_type, "message": text},
        "request_id": request_id,
    }


def new_request_id() -> str:
    """A fresh `req_...` id, as sent in the `request-id` header."""
    return f"req_{secrets.token_hex(12)}"


def new_message_id() -> str:
    """A fresh `msg_...` id."""
    return f"msg_{secrets.token_hex(12)}"


def estimate_tokens(text: str) -> int:
    """Roughly four characters per token; deterministic, which is all tests need."""
    return max(1, math.ceil(len(text) / 4))


def frame(event: str, data: Mapping[str, Any]) -> bytes:
    """One SSE event: `event: NAME\\ndata: JSON\\n\\n`."""
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event}\ndata: {payload}\n\n".encode()


def chunk_text(text: str, words: int = TEXT_WORDS_PER_DELTA) -> list[str]:
    """Split text into pieces of a few words each, keeping every character."""
    lead = len(text) - len(text.lstrip())
    tokens = re.findall(r"\S+\s*", text[lead:])
    if not tokens:
        return [text] if text else []
    tokens[0] = text[:lead] + tokens[0]
    return ["".join(tokens[i : i + words]) for i in range(0, len(tokens), words)]


def chunk_json(value: Mapping[str, Any], size: int = JSON_CHARS_PER_DELTA) -> list[str]:
    """Tool input as partial-JSON fragments; the first is empty, as the real API's often is."""
    text = json.dumps(value)
    return ["", *(text[i : i + size] for i in range(0, len(text), size))]


# Rendering a turn -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RenderedTurn:
    """A turn resolved against one request: ids, model, token counts, stop reason."""

    turn: MessageTurn
    blocks: tuple[Block, ...]
    message_id: str
    model: str
    usage: Usage
    stop_reason: str
    tool_ids: tuple[str | None, ...]


def resolve_turn(
    turn: MessageTurn,
    body: Mapping[str, Any],
    tool_id_seed: str,
    cache: Accounting | None = None,
) -> RenderedTurn:
    """Fill the turn's defaults from the request: model, usage (its input as the prompt cache
    paid it, when given), stop reason, tool ids."""
    blocks = turn.content()
    has_tool = any(isinstance(block, ToolUseBlock) for block in blocks)
    output_tokens = sum(_block_tokens(block) for block in blocks)
    if cache is None:
        cache = Accounting(input_tokens=input_tokens_for(body))
    usage = turn.usage or Usage(
        input_tokens=cache.input_tokens,
        output_tokens=output_tokens,
        cache_creation_input_tokens=cache.cache_creation_input_tokens,
        cache_read_input_tokens=cache.cache_read_input_tokens,
        ephemeral_5m_input_tokens=cache.ephemeral_5m_input_tokens,
        ephemeral_1h_input_tokens=cache.ephemeral_1h_input_tokens,
    )
    stop_reason = turn.stop_reason or ("tool_use" if has_tool else "end_turn")
    # As the API does, a turn never produces more than the request's max_tokens: its count is
    # cut there and it stops for that reason (its content is sent as scripted).
    limit = body.get("max_tokens")
    if isinstance(limit, int) and 0 < limit < usage.output_tokens:
        usage = dataclasses.replace(usage, output_tokens=limit)
        stop_reason = "max_tokens"
    tool_ids = tuple(
        (block.id or f"toolu_{tool_id_seed}{index:02d}")
        if isinstance(block, ToolUseBlock)
        else None
        for index, block in enumerate(blocks)
    )
    return RenderedTurn(
        turn=turn,
        blocks=blocks,
        message_id=turn.message_id or new_message_id(),
        model=turn.model or str(body.get("model", "claude-tether-demo")),
        usage=usage,
        stop_reason=stop_reason,
        tool_ids=tool_ids,
    )


def _block_tokens(block: Block) -> int:
    if isinstance(block, TextBlock):
        return estimate_tokens(block.text)
    if isinstance(block, ThinkingBlock):
        return estimate_tokens(block.thinking)
    return estimate_tokens(block.name + json.dumps(dict(block.input)))


def message_json(rendered: RenderedTurn) -> dict[str, Any]:
    """The non-streaming response body: a complete Message with every documented field."""
    return {
        "id": rendered.message_id,
        "type": "message",
        "role": "assistant",
        "model": rendered.model,
        "content": [
            _final_block(block, tool_id)
            for block, tool_id in zip(rendered.blocks, rendered.tool_ids, strict=True)
        ],
        "stop_reason": rendered.stop_reason,
        "stop_sequence": None,
        "usage": _usage_json(rendered.usage, rendered.usage.output_tokens),
    }


def _usage_json(usage: Usage, output_tokens: int) -> dict[str, Any]:
    """A usage object as the API sends it; `cache_creation` by lifetime when there were writes."""
    out: dict[str, Any] = {
        "input_tokens": usage.input_tokens,
        "cache_creation_input_tokens": usage.cache_creation_input_tokens,
        "cache_read_input_tokens": usage.cache_read_input_tokens,
    }
    if usage.cache_creation_input_tokens:
        out["cache_creation"] = {
            "ephemeral_5m_input_tokens": usage.ephemeral_5m_input_tokens,
            "ephemeral_1h_input_tokens": usage.ephemeral_1h_input_tokens,
        }
    out["output_tokens"] = output_tokens
    return out


def _final_block(block: Block, tool_id: str | None) -> dict[str, Any]:
    if isinstance(block, TextBlock):
        return {"type": "text", "text": block.text}
    if isinstance(block, ThinkingBlock):
        return {"type": "thinking", "thinking": block.thinking, "signature": block.signature}
    return {"type": "tool_use", "id": tool_id, "name": block.name, "input": dict(block.input)}


def stream_events(rendered: RenderedTurn) -> list[tuple[str, dict[str, Any]]]:
    """Every SSE event of the turn in order, from `message_start` to `message_stop`."""
    usage = rendered.usage
    events: list[tuple[str, dict[str, Any]]] = [
        (
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": rendered.message_id,
                    "type": "message",
                    "role": "assistant",
                    "model": rendered.model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": _usage_json(usage, usage.initial_output_tokens),
                },
            },
        )
    ]
    for index, (block, tool_id) in enumerate(zip(rendered.blocks, rendered.tool_ids, strict=True)):
        events.append(
            (
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": index,
                    "content_block": _start(block, tool_id),
                },
            )
        )
        if index == 0 and rendered.turn.ping:
            events.append(("ping", {"type": "ping"}))
        events.extend(
            ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
            for delta in _deltas(block)
        )
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    events.append(
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": rendered.stop_reason, "stop_sequence": None},
                "usage": {"output_tokens": usage.output_tokens},
            },
        )
    )
    events.append(("message_stop", {"type": "message_stop"}))
    return events


def _start(block: Block, tool_id: str | None) -> dict[str, Any]:
    if isinstance(block, TextBlock):
        return {"type": "text", "text": ""}
    if isinstance(block, ThinkingBlock):
        return {"type": "thinking", "thinking": "", "signature": ""}
    return {"type": "tool_use", "id": tool_id, "name": block.name, "input": {}}


def _deltas(block: Block) -> list[dict[str, Any]]:
    if isinstance(block, TextBlock):
        pieces = list(block.chunks) if block.chunks is not None else chunk_text(block.text)
        return [{"type": "text_delta", "text": piece} for piece in pieces]
    if isinstance(block, ThinkingBlock):
        pieces = list(block.chunks) if block.chunks is not None else chunk_text(block.thinking)
        return [
            *({"type": "thinking_delta", "thinking": piece} for piece in pieces),
            {"type": "signature_delta", "signature": block.signature},
        ]
    fragments = (
        list(block.json_chunks) if block.json_chunks is not None else chunk_json(block.input)
    )
    return [{"type": "input_json_delta", "partial_json": piece} for piece in fragments]


# Checking a request ---------------------------------------------------------------------------


def request_problem(body: Any) -> str | None:
    """Why the real API would reject this body with 400, or None if it looks valid.

    Only the mistakes a runtime is likely to make are checked: missing required fields and
    tool results that do not open the message after a tool call.
    """
    if not isinstance(body, dict):
        return "request body must be a JSON object"
    for name in ("model", "max_tokens", "messages"):
        if name not in body:
            return f"{name}: Field required"
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        return "messages: at least one message is required"
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            return f"messages.{index}: role must be 'user' or 'assistant'"
    for index, message in enumerate(messages[:-1]):
        calls = _blocks_of(message, "tool_use")
        if message["role"] != "assistant" or not calls:
            continue
        following = messages[index + 1]
        content = following.get("content")
        leading = 0
        if isinstance(content, list):
            for block in content:
                if not (isinstance(block, dict) and block.get("type") == "tool_result"):
                    break
                leading += 1
        if following["role"] != "user" or leading < len(calls):
            return (
                f"messages.{index + 1}: Did not find {len(calls)} `tool_result` block(s) at the "
                "beginning of this message. Messages following `tool_use` blocks must begin "
                "with a matching number of `tool_result` blocks."
            )
    return None


def _blocks_of(message: Mapping[str, Any], block_type: str) -> list[Mapping[str, Any]]:
    content = message.get("content")
    if not isinstance(content, list):
        return []
    return [b for b in content if isinstance(b, Mapping) and b.get("type") == block_type]
