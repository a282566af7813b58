"""One model turn streamed by the worker through the real SDK from the local model server: its
blocks become domain parts, its text deltas go out live with their offsets, and a stream cut
off leaves its part as it stood."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anthropic
import httpx2
import pytest

from services.worker.model import stream_turn
from services.worker.transcript import Transcript
from tether.domain import EventType, Part, Role, Text, Thinking, ToolCall
from tether.testing.model_server import (
    BlocksTurn,
    Cut,
    ModelServer,
    TextBlock,
    TextTurn,
    ThinkingBlock,
    ToolUseBlock,
)


@pytest.fixture
async def server() -> AsyncIterator[ModelServer]:
    async with ModelServer() as running:
        yield running


@pytest.fixture
async def client(
    server: ModelServer, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[anthropic.AsyncAnthropic]:
    # The SDK merges this variable into every request; keep the developer's shell out of it.
    monkeypatch.delenv("ANTHROPIC_CUSTOM_HEADERS", raising=False)
    sdk = anthropic.AsyncAnthropic(base_url=server.base_url, api_key="test", max_retries=0)
    yield sdk
    await sdk.close()


class Deltas:
    """The live deltas a turn published: (part index, text, offset)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, str, int]] = []

    async def publish(self, part_index: int, text: str, offset: int) -> None:
        self.seen.append((part_index, text, offset))


async def _stream(
    client: anthropic.AsyncAnthropic, prompt: str, transcript: Transcript, deltas: Deltas
) -> list[ToolCall]:
    result = await stream_turn(
        client,
        request={"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": prompt}]},
        transcript=transcript,
        checkpoint=lambda: None,
        publish_delta=deltas.publish,
        checkpoint_interval_s=60.0,
    )
    return result.tool_calls


async def test_a_streamed_turn_becomes_final_parts_and_live_deltas(
    server: ModelServer, client: anthropic.AsyncAnthropic
) -> None:
    turn = BlocksTurn(
        blocks=[
            ThinkingBlock("Weigh it.", "sig_1"),
            TextBlock("Let me look that up.", chunks=["Let me look that", " up."]),
            ToolUseBlock(
                "read_file",
                {"path": "src/main.py", "limit": 20},
                id="toolu_1",
                json_chunks=["", '{"path": "src/ma', 'in.py", "limit": 20}'],
            ),
        ]
    )
    server.script("show me main.py", [turn])
    transcript, deltas = Transcript([]), Deltas()
    calls = await _stream(client, "show me main.py", transcript, deltas)
    call = ToolCall("toolu_1", "read_file", {"path": "src/main.py", "limit": 20.0})
    assert calls == [call]
    assert list(transcript.parts) == [
        Part(0, Role.ASSISTANT, Thinking("Weigh it.", "sig_1"), final=True),
        Part(1, Role.ASSISTANT, Text("Let me look that up."), final=True),
        Part(2, Role.ASSISTANT, call, final=True),
    ]
    assert deltas.seen == [(1, "Let me look that", 0), (1, " up.", 16)]
    batch = transcript.take(1)
    # Each block started and ended within the one batch: one part.added each, carrying the
    # final part.
    assert [e.type for e in batch.events] == [EventType.PART_ADDED] * 3
    assert [e.payload["part"]["final"] for e in batch.events] == [True] * 3
    assert batch.parts == tuple(transcript.parts)


async def test_a_stream_cut_off_leaves_its_part_unfinished_as_it_stood(
    server: ModelServer, client: anthropic.AsyncAnthropic
) -> None:
    words = ["Hel", "lo ", "there, ", "my ", "friend"]
    server.script("greet", [TextTurn("".join(words), chunks=words, fault=Cut(after_events=5))])
    transcript, deltas = Transcript([]), Deltas()
    with pytest.raises(httpx2.RemoteProtocolError):
        await _stream(client, "greet", transcript, deltas)
    assert deltas.seen, "the cut comes mid-text"
    (part,) = transcript.take(1).parts
    assert not part.final
    assert isinstance(part.content, Text)
    assert part.content.text == "".join(text for _, text, _ in deltas.seen)
    assert "Hello there, my friend".startswith(part.content.text)
