"""Scripted turns for the local model server: what to answer, and how to misbehave.

A test queues turns under a *script key*; each `POST /v1/messages` whose key matches takes the
next turn from the front of the queue. Turns are plain frozen dataclasses so the same script can
be written in Python or sent as JSON to `POST /_script` (see `turn_from_json`).

Faults (`MidStreamError`, `Stall`, `Cut`, `Truncated`) are stream-level: attach one to a message
turn with `fault=...`, or queue a bare fault to get a short canned text answer that fails.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

DEFAULT_KEY = "default"
"""Queue used when a request names no key of its own, and as the fallback for any request."""

KEY_HEADER = "x-tether-script"
"""Request header that selects a script queue explicitly."""

KEY_TEXT_LIMIT = 200
"""How much of the first user message forms the implicit key; long prompts stay addressable."""

FAULT_BODY_TEXT = (
    "This answer streams in several small pieces so that a scripted fault can interrupt it "
    "part of the way through."
)
"""Body streamed by a bare fault turn: long enough for several deltas before the fault."""

StopReason = Literal[
    "end_turn",
    "max_tokens",
    "stop_sequence",
    "tool_use",
    "pause_turn",
    "refusal",
    "model_context_window_exceeded",
]


# Content blocks -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TextBlock:
    """A text block; `chunks` pins the exact `text_delta` pieces (they must join to `text`)."""

    text: str
    chunks: Sequence[str] | None = None

    def __post_init__(self) -> None:
        _check_chunks(self.chunks, self.text)


@dataclass(frozen=True)
class ThinkingBlock:
    """An extended-thinking block, streamed as thinking deltas then one signature delta."""

    thinking: str
    signature: str = "sig_tether_demo"
    chunks: Sequence[str] | None = None

    def __post_init__(self) -> None:
        _check_chunks(self.chunks, self.thinking)


@dataclass(frozen=True)
class ToolUseBlock:
    """A tool call. `json_chunks` pins the `input_json_delta` fragments (must join to JSON)."""

    name: str
    input: Mapping[str, Any] = field(default_factory=dict)
    id: str | None = None
    json_chunks: Sequence[str] | None = None


Block = TextBlock | ThinkingBlock | ToolUseBlock


def _check_chunks(chunks: Sequence[str] | None, whole: str) -> None:
    # Tool-input fragments are left unchecked on purpose: invalid JSON is a legitimate script.
    if chunks is not None and "".join(chunks) != whole:
        raise ValueError(f"chunks {list(chunks)!r} do not join to {whole!r}")


@dataclass(frozen=True)
class Usage:
    """Token counts to report instead of the ones derived from text lengths.

    `initial_output_tokens` is the count the real API puts in `message_start` before any
    content is generated; `output_tokens` is the cumulative count in `message_delta`.
    """

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    initial_output_tokens: int = 1
    # The cache writes by lifetime (`usage.cache_creation`), sent when there were any.
    ephemeral_5m_input_tokens: int = 0
    ephemeral_1h_input_tokens: int = 0


# Faults ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MidStreamError:
    """Send `event: error` after `after_events` events and end the body (HTTP status stays 200)."""

    after_events: int
    error_type: str = "overloaded_error"
    message: str = "Overloaded"


@dataclass(frozen=True)
class Stall:
    """Stop sending after `after_events` events for `seconds`, or until the client goes away.

    After a bounded stall the rest of the stream is sent normally.
    """

    after_events: int
    seconds: float | None = None


@dataclass(frozen=True)
class Cut:
    """Abort the TCP connection after `after_events` events, leaving the chunked body unfinished."""

    after_events: int


@dataclass(frozen=True)
class Truncated:
    """End the body cleanly after `after_events` events, i.e. before `message_stop`."""

    after_events: int


Fault = MidStreamError | Stall | Cut | Truncated


# Turns ----------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MessageTurn:
    """Options shared by every turn that answers with a message.

    `stop_reason` defaults to `tool_use` when the content has a tool call, else `end_turn`.
    `model` defaults to the model the request named. `delay_ms` is slept before every
    content delta so tests can stream slowly (streaming requests only). `ping` sends one
    `ping` event after the first `content_block_start`, as the real API does.
    """

    fault: Fault | None = None
    delay_ms: float = 0.0
    stop_reason: StopReason | None = None
    usage: Usage | None = None
    model: str | None = None
    message_id: str | None = None
    ping: bool = True

    def content(self) -> tuple[Block, ...]:
        """The content blocks of the answer, in order."""
        raise NotImplementedError


@dataclass(frozen=True)
class TextTurn(MessageTurn):
    """Answer with one text block."""

    text: str
    chunks: Sequence[str] | None = None

    def __post_init__(self) -> None:
        _check_chunks(self.chunks, self.text)

    def content(self) -> tuple[Block, ...]:
        """One text block."""
        return (TextBlock(self.text, self.chunks),)


@dataclass(frozen=True)
class ToolUseTurn(MessageTurn):
    """Call one tool, optionally after a text preamble."""

    name: str
    input: Mapping[str, Any] = field(default_factory=dict)
    text: str | None = None
    tool_id: str | None = None
    json_chunks: Sequence[str] | None = None

    def content(self) -> tuple[Block, ...]:
        """The preamble (if any) then the tool call."""
        call = ToolUseBlock(self.name, self.input, self.tool_id, self.json_chunks)
        return (call,) if self.text is None else (TextBlock(self.text), call)


@dataclass(frozen=True)
class BlocksTurn(MessageTurn):
    """Answer with any sequence of blocks (e.g. thinking, text, several tool calls)."""

    blocks: Sequence[Block]

    def content(self) -> tuple[Block, ...]:
        """The blocks as given."""
        return tuple(self.blocks)


@dataclass(frozen=True)
class ErrorTurn:
    """Answer with an HTTP error before any stream starts.

    `error_type` defaults to the type the real API uses for `status`. `retry_after` becomes the
    `retry-after` header verbatim (seconds, or an HTTP date string); `retry_after_ms` becomes
    `retry-after-ms`; `should_retry` becomes `x-should-retry: true|false`.
    """

    status: int
    error_type: str | None = None
    message: str | None = None
    retry_after: float | str | None = None
    retry_after_ms: float | str | None = None
    should_retry: bool | None = None
    headers: Mapping[str, str] = field(default_factory=dict)


Turn = TextTurn | ToolUseTurn | BlocksTurn | ErrorTurn | MidStreamError | Stall | Cut | Truncated


def as_message_turn(turn: MessageTurn | Fault) -> MessageTurn:
    """A bare fault becomes the canned text answer carrying that fault."""
    if isinstance(turn, MessageTurn):
        return turn
    return TextTurn(FAULT_BODY_TEXT, fault=turn)


# JSON form ------------------------------------------------------------------------------------


class ScriptFormatError(ValueError):
    """A JSON turn sent to the control API is malformed."""


def turn_from_json(raw: Mapping[str, Any]) -> Turn:
    """Parse one JSON turn (the `POST /_script` format) into a turn.

    Kinds: `text`, `tool_use`, `blocks`, `error`, `mid_stream_error`, `stall`, `cut`,
    `truncated`. Message kinds also take `delay_ms`, `stop_reason`, `model`, `message_id`,
    `ping`, `usage` and a nested `fault`; fault kinds take `delay_ms` and `text` for their body.
    """
    try:
        kind = raw["kind"]
        if kind == "error":
            return _error_from_json(raw)
        if kind in _FAULT_KINDS:
            return TextTurn(
                str(raw.get("text", FAULT_BODY_TEXT)),
                fault=_fault_from_json(raw),
                **_options_from_json(raw),
            )
        if kind == "text":
            return TextTurn(
                str(raw["text"]), chunks=_strs(raw.get("chunks")), **_message_options(raw)
            )
        if kind == "tool_use":
            return ToolUseTurn(
                name=str(raw["name"]),
                input=dict(raw.get("input") or {}),
                text=None if raw.get("text") is None else str(raw["text"]),
                tool_id=raw.get("id"),
                json_chunks=_strs(raw.get("json_chunks")),
                **_message_options(raw),
            )
        if kind == "blocks":
            blocks = [_block_from_json(block) for block in raw["blocks"]]
            return BlocksTurn(blocks=blocks, **_message_options(raw))
    except (KeyError, TypeError, ValueError) as exc:
        raise ScriptFormatError(f"bad turn {raw!r}: {exc!r}") from exc
    raise ScriptFormatError(f"unknown turn kind {raw.get('kind')!r}")


_FAULT_KINDS = frozenset({"mid_stream_error", "stall", "cut", "truncated"})


def _fault_from_json(raw: Mapping[str, Any]) -> Fault:
    kind = raw["kind"]
    after = int(raw.get("after_events", 0))
    if kind == "mid_stream_error":
        return MidStreamError(
            after,
            str(raw.get("type", "overloaded_error")),
            str(raw.get("message", "Overloaded")),
        )
    if kind == "stall":
        seconds = raw.get("seconds")
        return Stall(after, None if seconds is None else float(seconds))
    if kind == "cut":
        return Cut(after)
    if kind == "truncated":
        return Truncated(after)
    raise ValueError(f"unknown fault kind {kind!r}")


def _options_from_json(raw: Mapping[str, Any]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if "delay_ms" in raw:
        options["delay_ms"] = float(raw["delay_ms"])
    for name in ("stop_reason", "model", "message_id"):
        if raw.get(name) is not None:
            options[name] = str(raw[name])
    if "ping" in raw:
        options["ping"] = bool(raw["ping"])
    if raw.get("usage") is not None:
        options["usage"] = Usage(**raw["usage"])
    return options


def _message_options(raw: Mapping[str, Any]) -> dict[str, Any]:
    options = _options_from_json(raw)
    if raw.get("fault") is not None:
        options["fault"] = _fault_from_json(raw["fault"])
    return options


def _block_from_json(raw: Mapping[str, Any]) -> Block:
    kind = raw["type"]
    if kind == "text":
        return TextBlock(str(raw["text"]), _strs(raw.get("chunks")))
    if kind == "thinking":
        return ThinkingBlock(
            str(raw["thinking"]),
            str(raw.get("signature", "sig_tether_demo")),
            _strs(raw.get("chunks")),
        )
    if kind == "tool_use":
        return ToolUseBlock(
            str(raw["name"]),
            dict(raw.get("input") or {}),
            raw.get("id"),
            _strs(raw.get("json_chunks")),
        )
    raise ValueError(f"unknown block type {kind!r}")


def _error_from_json(raw: Mapping[str, Any]) -> ErrorTurn:
    should_retry = raw.get("should_retry")
    return ErrorTurn(
        status=int(raw["status"]),
        error_type=raw.get("type"),
        message=raw.get("message"),
        retry_after=raw.get("retry_after"),
        retry_after_ms=raw.get("retry_after_ms"),
        should_retry=None if should_retry is None else bool(should_retry),
        headers={str(k): str(v) for k, v in (raw.get("headers") or {}).items()},
    )


def _strs(value: Any) -> tuple[str, ...] | None:
    return None if value is None else tuple(str(item) for item in value)


# The queues -----------------------------------------------------------------------------------


class ScriptBook:
    """Turn queues by script key. Not thread-safe; lives on the server's event loop."""

    def __init__(self) -> None:
        self._queues: dict[str, deque[Turn]] = {}

    def add(self, key: str | None, turns: Iterable[Turn]) -> int:
        """Append turns to the queue for `key` (None: the default queue); returns its length."""
        queue = self._queues.setdefault(key or DEFAULT_KEY, deque())
        queue.extend(turns)
        return len(queue)

    def take(self, key: str | None) -> Turn | None:
        """Pop the next turn for `key`, falling back to the default queue; None when both are empty.

        The fallback lets a test script "whatever comes next" without knowing how the runtime
        under test phrases its prompts.
        """
        for candidate in (key, DEFAULT_KEY):
            queue = self._queues.get(candidate or DEFAULT_KEY)
            if queue:
                return queue.popleft()
        return None

    def pending(self, key: str | None = None) -> int:
        """How many turns wait under `key` (`None` means the default queue)."""
        return len(self._queues.get(key or DEFAULT_KEY, ()))

    def drop(self, key: str | None) -> int:
        """Drop the turns queued under `key`; returns how many there were."""
        return len(self._queues.pop(key or DEFAULT_KEY, ()))

    def clear(self) -> None:
        """Drop every queued turn."""
        self._queues.clear()


def script_key(headers: Mapping[str, str], body: Mapping[str, Any]) -> str:
    """The key a request selects: its `x-tether-script` header, else its first user text.

    The first user message is stable across every turn of one conversation, so a whole
    tool-use loop can be scripted under the prompt that started it. Its text is its last text
    block: what the user wrote, after whatever context a runtime put before it (live facts,
    retrieved documents).
    """
    explicit = headers.get(KEY_HEADER)
    if explicit:
        return explicit
    for message in body.get("messages") or ():
        if isinstance(message, Mapping) and message.get("role") == "user":
            text = newest_text(message.get("content"))
            if text:
                return text[:KEY_TEXT_LIMIT]
            break
    return DEFAULT_KEY


def newest_text(content: Any) -> str:
    """A user message's own words: the string itself, or its last text block (context a
    runtime sends with a message goes before it)."""
    if isinstance(content, list):
        texts = [
            str(block.get("text", ""))
            for block in content
            if isinstance(block, Mapping) and block.get("type") == "text"
        ]
        return texts[-1] if texts else ""
    return message_text(content)


def message_text(content: Any) -> str:
    """A message's `content` as text: the string itself, or its text blocks joined by newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(block.get("text", ""))
            for block in content
            if isinstance(block, Mapping) and block.get("type") == "text"
        )
    return ""
