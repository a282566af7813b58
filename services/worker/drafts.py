"""Parts still streaming. A Part is frozen, and rebuilding one at every token would copy its text
whole each time; a draft collects the chunks instead, and `freeze` makes the Part as it stands
when the transcript takes a checkpoint or the block ends.
"""

from __future__ import annotations

import json
from typing import Any

from tether.domain import Part, Role, Text, Thinking, ToolCall


class Draft:
    """A part being streamed; the transcript gives it its `index` when it opens it."""

    __slots__ = ("index",)

    def __init__(self) -> None:
        self.index = -1

    @property
    def size(self) -> int:
        """How much of the part its frozen form holds so far, in characters (what a stored
        snapshot of it weighs)."""
        raise NotImplementedError

    def freeze(self, *, final: bool) -> Part:
        """The part as it stands (`final` once its block ended)."""
        raise NotImplementedError


class TextDraft(Draft):
    """Prose as it streams; `length` is what arrived so far, in characters."""

    __slots__ = ("_chunks", "length")

    def __init__(self, text: str = "") -> None:
        super().__init__()
        self._chunks = [text] if text else []
        self.length = len(text)

    @property
    def size(self) -> int:
        return self.length

    def extend(self, text: str) -> int:
        """Append `text`; returns where it starts in the part (a delta's offset)."""
        offset = self.length
        self._chunks.append(text)
        self.length += len(text)
        return offset

    def freeze(self, *, final: bool) -> Part:
        """The text part as it stands."""
        return Part(self.index, Role.ASSISTANT, Text(_joined(self._chunks)), final)


class ThinkingDraft(Draft):
    """Extended thinking and its signature as they stream."""

    __slots__ = ("_signature", "_size", "_thinking")

    def __init__(self, thinking: str = "", signature: str = "") -> None:
        super().__init__()
        self._thinking = [thinking] if thinking else []
        self._signature = [signature] if signature else []
        self._size = len(thinking) + len(signature)

    @property
    def size(self) -> int:
        return self._size

    def extend(self, thinking: str) -> None:
        """Append thinking."""
        self._thinking.append(thinking)
        self._size += len(thinking)

    def sign(self, signature: str) -> None:
        """Append to the signature."""
        self._signature.append(signature)
        self._size += len(signature)

    def freeze(self, *, final: bool) -> Part:
        """The thinking part as it stands."""
        content = Thinking(_joined(self._thinking), _joined(self._signature))
        return Part(self.index, Role.ASSISTANT, content, final)


class ToolCallDraft(Draft):
    """A tool call whose input streams as partial JSON, parsed once its block ends: until then
    the part holds the input the block started with."""

    __slots__ = ("_input", "_json", "name", "tool_call_id")

    def __init__(self, tool_call_id: str, name: str, input: dict[str, Any]) -> None:
        super().__init__()
        self.tool_call_id = tool_call_id
        self.name = name
        self._input = input
        self._json: list[str] = []

    @property
    def size(self) -> int:
        # Its snapshot holds the input the block started with until the block ends: a stored
        # snapshot never grows, however much JSON has arrived.
        return 0

    def extend(self, partial_json: str) -> None:
        """Append a piece of the input's JSON."""
        self._json.append(partial_json)

    def freeze(self, *, final: bool) -> Part:
        """The call as it stands; ValueError when its whole input is not a JSON object."""
        input = self._input
        if final:
            text = _joined(self._json)
            if text.strip():
                input = json.loads(text)
                if not isinstance(input, dict):
                    raise ValueError(f"the input of tool call {self.tool_call_id} is no object")
        content = ToolCall(self.tool_call_id, self.name, input)
        return Part(self.index, Role.ASSISTANT, content, final)


def _joined(chunks: list[str]) -> str:
    """The chunks as one string, kept joined so that the next freeze starts from it."""
    if len(chunks) > 1:
        chunks[:] = ["".join(chunks)]
    return chunks[0] if chunks else ""
