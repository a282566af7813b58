"""The worker's lean event-stream reader (`services.worker.sse`) against the SDK's own decoder on
the same bytes: the same events, whatever the line ends and however the body is chunked; and an
`error` event raises the error the SDK raises for it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import anthropic
import httpx2
from anthropic._streaming import SSEDecoder  # the SDK's framing, to hold ours to it
from hypothesis import given, settings
from hypothesis import strategies as st

from services.worker.provider_errors import classify_exception
from services.worker.sse import server_sent_events, stream_error

# A streamed turn as the API sends it (a ping, a tool call whose input streams in pieces).
TURN = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","type":'
    b'"message","role":"assistant","model":"m","content":[],"stop_reason":null,'
    b'"usage":{"input_tokens":412,"output_tokens":2}}}\n\n'
    b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
    b'"content_block":{"type":"text","text":""}}\n\n'
    b'event: ping\ndata: {"type":"ping"}\n\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":"Let me look \xc3\xa9 up."}}\n\n'
    b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
    b'event: content_block_start\ndata: {"type":"content_block_start","index":1,'
    b'"content_block":{"type":"tool_use","id":"toolu_1","name":"read_file","input":{}}}\n\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":1,'
    b'"delta":{"type":"input_json_delta","partial_json":"{\\"path\\": \\"src/ma"}}\n\n'
    b": a comment\n\n"
    b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"tool_use"},'
    b'"usage":{"output_tokens":41}}\n\n'
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
)


async def _chunked(body: bytes, cuts: list[int]) -> AsyncIterator[bytes]:
    start = 0
    for cut in sorted({c % (len(body) + 1) for c in cuts}):
        yield body[start:cut]
        start = cut
    yield body[start:]


def _kept(name: str | None, data: str) -> bool:
    """What a stream yields or raises for (the SDK skips the rest)."""
    return name is not None and name != "ping" and bool(data)


async def _sdk(body: bytes, cuts: list[int]) -> list[tuple[str | None, str]]:
    return [
        (e.event, e.data)
        async for e in SSEDecoder().aiter_bytes(_chunked(body, cuts))
        if _kept(e.event, e.data)
    ]


async def _ours(body: bytes, cuts: list[int]) -> list[tuple[str | None, str]]:
    return [
        (name, data.decode())
        async for name, data in server_sent_events(_chunked(body, cuts))
        if _kept(name, data.decode())
    ]


async def test_a_streamed_turn_reads_as_the_sdk_reads_it_every_way_it_can_be_cut() -> None:
    expected = await _sdk(TURN, [])
    assert [name for name, _ in expected] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "message_delta",
        "message_stop",
    ]
    assert json.loads(expected[2][1])["delta"]["text"] == "Let me look \u00e9 up."
    for cut in range(len(TURN) + 1):
        assert await _ours(TURN, [cut]) == expected, f"cut at byte {cut}"


_FIELD_TEXT = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=12
)
_EVENT = st.tuples(
    st.one_of(st.none(), st.sampled_from(["message_start", "ping", "error", "x y", ""])),
    st.lists(_FIELD_TEXT, max_size=3),  # data lines
    st.booleans(),  # a comment line first
    st.booleans(),  # a space after each colon
)


@settings(max_examples=300, deadline=None)
@given(
    events=st.lists(_EVENT, max_size=6),
    line_end=st.sampled_from([b"\n", b"\r\n", b"\r"]),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=8),
    trailing=st.booleans(),
)
async def test_any_event_stream_reads_as_the_sdk_reads_it(
    events: list[tuple[str | None, list[str], bool, bool]],
    line_end: bytes,
    cuts: list[int],
    trailing: bool,
) -> None:
    lines: list[bytes] = []
    for name, data, comment, space in events:
        gap = " " if space else ""
        if comment:
            lines.append(f":{gap}note".encode())
        if name is not None:
            lines.append(f"event:{gap}{name}".encode())
        lines += [f"data:{gap}{line}".encode() for line in data]
        lines.append(b"")
    body = line_end.join(lines) + (line_end if trailing else b"")
    assert await _ours(body, cuts) == await _sdk(body, cuts)


def test_an_error_event_raises_what_the_sdk_raises_and_is_classified_alike() -> None:
    request = httpx2.Request("POST", "https://api.example/v1/messages")
    response = httpx2.Response(200, request=request, headers={"request-id": "req_1"})
    data = b'{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}'
    ours = stream_error(data, response)
    body = json.loads(data)
    sdk = anthropic.AsyncAnthropic(api_key="k")._make_status_error(
        f"{body}", body=body, response=response
    )
    assert type(ours) is type(sdk) and isinstance(ours, anthropic.APIStatusError)
    assert (ours.status_code, ours.type, ours.body, str(ours)) == (
        sdk.status_code,
        sdk.type,
        sdk.body,
        str(sdk),
    )
    assert classify_exception(ours) == classify_exception(sdk)
    assert classify_exception(ours).retryable, "an overloaded stream is retried"
