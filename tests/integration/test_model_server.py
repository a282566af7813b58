"""The local model server against the real `anthropic` SDK: wire format, faults, scripting.

Every test talks to the server through the SDK (or raw httpx2 where the SDK hides the wire);
nothing in the SDK is mocked.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import pytest

import tether.testing.model_server as model_server_module
from services.worker.provider_errors import StreamIncomplete, classify_exception
from tether.retry import ProviderCode
from tether.testing.model_script import FAULT_BODY_TEXT
from tether.testing.model_server import (
    BlocksTurn,
    Cut,
    ErrorTurn,
    MidStreamError,
    ModelServer,
    Stall,
    TextBlock,
    TextTurn,
    ThinkingBlock,
    ToolUseBlock,
    ToolUseTurn,
    Truncated,
    Usage,
)

# Copied byte for byte from the verified reference stream (example_stream.sse, 1653 bytes,
# sha256 7809ad0e…9233): the SDK parses it to "Let me look that up." plus a read_file call.
EXAMPLE_STREAM = (
    b"event: message_start\n"
    b'data: {"type":"message_start","message":{"id":"msg_01TESTabcdefghijklmnop",'
    b'"type":"message","role":"assistant","model":"claude-sonnet-5-5","content":[],'
    b'"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":412,'
    b'"cache_creation_input_tokens":0,"cache_read_input_tokens":0,"output_tokens":2}}}\n'
    b"\n"
    b"event: content_block_start\n"
    b'data: {"type":"content_block_start","index":0,"content_block":{"type":"text",'
    b'"text":""}}\n'
    b"\n"
    b"event: ping\n"
    b'data: {"type":"ping"}\n'
    b"\n"
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta",'
    b'"text":"Let me look that"}}\n'
    b"\n"
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta",'
    b'"text":" up."}}\n'
    b"\n"
    b"event: content_block_stop\n"
    b'data: {"type":"content_block_stop","index":0}\n'
    b"\n"
    b"event: content_block_start\n"
    b'data: {"type":"content_block_start","index":1,"content_block":{"type":"tool_use",'
    b'"id":"toolu_01TESTxyz","name":"read_file","input":{}}}\n'
    b"\n"
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta",'
    b'"partial_json":""}}\n'
    b"\n"
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta",'
    b'"partial_json":"{\\"path\\": \\"src/ma"}}\n'
    b"\n"
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta",'
    b'"partial_json":"in.py\\", \\"limit\\": 20}"}}\n'
    b"\n"
    b"event: content_block_stop\n"
    b'data: {"type":"content_block_stop","index":1}\n'
    b"\n"
    b"event: message_delta\n"
    b'data: {"type":"message_delta","delta":{"stop_reason":"tool_use",'
    b'"stop_sequence":null},"usage":{"output_tokens":41}}\n'
    b"\n"
    b"event: message_stop\n"
    b'data: {"type":"message_stop"}\n'
    b"\n"
)
EXAMPLE_STREAM_SHA256 = "7809ad0e8bfc4e0448b2f480f1e011f7dbb374d6c3f29331eb0a023ad09f9233"

WAIT = 10.0
"""Upper bound for any wait on the server's log; generous, only hit when something is broken."""

LIBS_DIR = Path(model_server_module.__file__).resolve().parents[2]


def ask(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def example_turn() -> BlocksTurn:
    """The scripted turn that reproduces EXAMPLE_STREAM exactly."""
    return BlocksTurn(
        blocks=[
            TextBlock("Let me look that up.", chunks=["Let me look that", " up."]),
            ToolUseBlock(
                "read_file",
                {"path": "src/main.py", "limit": 20},
                id="toolu_01TESTxyz",
                json_chunks=["", '{"path": "src/ma', 'in.py", "limit": 20}'],
            ),
        ],
        message_id="msg_01TESTabcdefghijklmnop",
        model="claude-sonnet-5-5",
        usage=Usage(input_tokens=412, output_tokens=41, initial_output_tokens=2),
    )


@pytest.fixture
async def server() -> AsyncIterator[ModelServer]:
    async with ModelServer() as running:
        yield running


def make_client(base_url: str, **options: Any) -> anthropic.AsyncAnthropic:
    options.setdefault("max_retries", 0)
    return anthropic.AsyncAnthropic(base_url=base_url, api_key="test", **options)


@pytest.fixture
async def client(
    server: ModelServer, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[anthropic.AsyncAnthropic]:
    # The SDK merges this variable into every request; keep the developer's shell out of it.
    monkeypatch.delenv("ANTHROPIC_CUSTOM_HEADERS", raising=False)
    sdk = make_client(server.base_url)
    yield sdk
    await sdk.close()


@pytest.fixture
async def http(server: ModelServer) -> AsyncIterator[httpx2.AsyncClient]:
    async with httpx2.AsyncClient(base_url=server.base_url) as raw:
        yield raw


API_HEADERS = {"x-api-key": "test", "anthropic-version": "2023-06-01"}


async def stream_text(client: anthropic.AsyncAnthropic, prompt: str, **kwargs: Any) -> str:
    async with client.messages.stream(
        model="claude-test", max_tokens=64, messages=ask(prompt), **kwargs
    ) as stream:
        return await stream.get_final_text()


async def wait_for_outcome(server: ModelServer, index: int, outcome: str) -> None:
    async with asyncio.timeout(WAIT):
        await server.wait_until(lambda log: len(log) > index and log[index].outcome == outcome)


# The wire format ------------------------------------------------------------------------------


def test_reference_copy_is_verbatim() -> None:
    assert len(EXAMPLE_STREAM) == 1653
    assert hashlib.sha256(EXAMPLE_STREAM).hexdigest() == EXAMPLE_STREAM_SHA256


async def test_example_stream_is_reproduced_byte_for_byte(
    server: ModelServer, http: httpx2.AsyncClient
) -> None:
    server.script("show me main.py", [example_turn()])
    body = {"model": "m", "max_tokens": 64, "stream": True, "messages": ask("show me main.py")}
    response = await http.post("/v1/messages", json=body, headers=API_HEADERS)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert response.headers["request-id"].startswith("req_")
    assert response.content == EXAMPLE_STREAM


async def test_sdk_parses_the_example_stream(
    server: ModelServer, client: anthropic.AsyncAnthropic
) -> None:
    server.script("show me main.py", [example_turn()])
    async with client.messages.stream(
        model="m", max_tokens=64, messages=ask("show me main.py")
    ) as stream:
        message = await stream.get_final_message()
        request_id = stream.request_id
    text, call = message.content
    assert text.type == "text"
    assert text.text == "Let me look that up."
    assert call.type == "tool_use"
    assert (call.id, call.name) == ("toolu_01TESTxyz", "read_file")
    assert call.input == {"path": "src/main.py", "limit": 20}
    assert message.stop_reason == "tool_use"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (412, 41)
    assert message.id == "msg_01TESTabcdefghijklmnop"
    assert request_id == server.requests[0].request_id


async def test_non_streaming_message_has_every_documented_field(
    server: ModelServer, client: anthropic.AsyncAnthropic, http: httpx2.AsyncClient
) -> None:
    server.script("show me main.py", [example_turn(), example_turn()])
    message = await client.messages.create(
        model="m", max_tokens=64, messages=ask("show me main.py")
    )
    assert [block.type for block in message.content] == ["text", "tool_use"]
    assert message.content[1].input == {"path": "src/main.py", "limit": 20}
    assert message.stop_reason == "tool_use"
    assert message.usage.cache_read_input_tokens == 0
    assert message._request_id == server.requests[0].request_id

    body = {"model": "m", "max_tokens": 64, "messages": ask("show me main.py")}
    raw = (await http.post("/v1/messages", json=body, headers=API_HEADERS)).json()
    assert list(raw) == [
        "id",
        "type",
        "role",
        "model",
        "content",
        "stop_reason",
        "stop_sequence",
        "usage",
    ]
    assert raw["usage"] == {
        "input_tokens": 412,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 41,
    }


async def test_tool_input_streams_as_several_partial_json_fragments(
    server: ModelServer, client: anthropic.AsyncAnthropic
) -> None:
    tool_input = {"query": "weather in Lisbon", "units": "metric", "days": [1, 2, 3]}
    server.script("forecast", [ToolUseTurn("get_forecast", tool_input, text="Checking.")])
    fragments: list[str] = []
    async with client.messages.stream(model="m", max_tokens=64, messages=ask("forecast")) as stream:
        async for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                fragments.append(event.delta.partial_json)
        message = await stream.get_final_message()
    assert fragments[0] == ""
    assert len(fragments) > 3
    assert json.loads("".join(fragments)) == tool_input
    assert message.content[1].input == tool_input
    assert message.stop_reason == "tool_use"


async def test_thinking_block_streams_with_its_signature(
    server: ModelServer, client: anthropic.AsyncAnthropic
) -> None:
    turn = BlocksTurn(blocks=[ThinkingBlock("Weigh both options.", "sig_abc"), TextBlock("B.")])
    server.script("think", [turn])
    async with client.messages.stream(model="m", max_tokens=64, messages=ask("think")) as stream:
        message = await stream.get_final_message()
    thinking, text = message.content
    assert thinking.type == "thinking"
    assert (thinking.thinking, thinking.signature) == ("Weigh both options.", "sig_abc")
    assert text.type == "text"
    assert text.text == "B."
    assert message.stop_reason == "end_turn"


async def test_slow_stream_paces_its_deltas(
    server: ModelServer, client: anthropic.AsyncAnthropic
) -> None:
    chunks = ["one ", "two ", "three ", "four ", "five"]
    server.script("slowly", [TextTurn("".join(chunks), chunks=chunks, delay_ms=40)])
    arrivals: list[float] = []
    async with client.messages.stream(model="m", max_tokens=64, messages=ask("slowly")) as stream:
        async for text in stream.text_stream:
            arrivals.append(time.monotonic())
            assert text in chunks
    assert len(arrivals) == len(chunks)
    # Five 40 ms pauses, one before each delta: the last delta lands at least 160 ms after
    # the first. A lower bound only, so a slow machine cannot make this flaky.
    assert arrivals[-1] - arrivals[0] >= 0.15


# Authentication and request checks --------------------------------------------------------------


async def test_missing_credentials_get_a_real_401(http: httpx2.AsyncClient) -> None:
    body = {"model": "m", "max_tokens": 8, "messages": ask("hi")}
    response = await http.post(
        "/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"}
    )
    assert response.status_code == 401
    payload = response.json()
    assert payload["type"] == "error"
    assert payload["error"]["type"] == "authentication_error"
    assert payload["error"]["message"]
    assert payload["request_id"] == response.headers["request-id"]
    assert payload["request_id"].startswith("req_")


async def test_both_auth_schemes_are_accepted(
    server: ModelServer, client: anthropic.AsyncAnthropic, http: httpx2.AsyncClient
) -> None:
    body = {"model": "m", "max_tokens": 8, "messages": ask("hi")}
    raw = await http.post("/v1/messages", json=body, headers=API_HEADERS)
    assert raw.status_code == 200
    await client.messages.create(model="m", max_tokens=8, messages=ask("hi"))
    assert [r.auth for r in server.requests] == ["x-api-key", "bearer"]
    assert all("x-api-key" not in r.headers for r in server.requests)  # never logged


async def test_missing_anthropic_version_is_rejected(http: httpx2.AsyncClient) -> None:
    body = {"model": "m", "max_tokens": 8, "messages": ask("hi")}
    response = await http.post("/v1/messages", json=body, headers={"x-api-key": "test"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


async def test_tool_use_without_tool_result_is_a_bad_request(
    client: anthropic.AsyncAnthropic,
) -> None:
    messages: list[Any] = [
        {"role": "user", "content": "read it"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {}}],
        },
        {"role": "user", "content": "never mind"},
    ]
    with pytest.raises(anthropic.BadRequestError) as caught:
        await client.messages.create(model="m", max_tokens=8, messages=messages)
    assert "tool_result" in str(caught.value.api_message)


# Scripted HTTP errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "error_class", "error_type"),
    [
        (400, anthropic.BadRequestError, "invalid_request_error"),
        (401, anthropic.AuthenticationError, "authentication_error"),
        (402, anthropic.PaymentRequiredError, "billing_error"),
        (403, anthropic.PermissionDeniedError, "permission_error"),
        (404, anthropic.NotFoundError, "not_found_error"),
        (408, anthropic.RequestTimeoutError, "timeout_error"),
        (409, anthropic.ConflictError, "conflict_error"),
        (413, anthropic.ContentTooLargeError, "request_too_large"),
        (429, anthropic.RateLimitError, "rate_limit_error"),
        (500, anthropic.InternalServerError, "api_error"),
        (503, anthropic.ServiceUnavailableError, "api_error"),
        (504, anthropic.GatewayTimeoutError, "timeout_error"),
        (529, anthropic.OverloadedError, "overloaded_error"),
    ],
)
async def test_error_status_raises_the_sdk_class(
    server: ModelServer,
    client: anthropic.AsyncAnthropic,
    status: int,
    error_class: type[anthropic.APIStatusError],
    error_type: str,
) -> None:
    server.script("fail", [ErrorTurn(status)])
    with pytest.raises(anthropic.APIStatusError) as caught:
        await stream_text(client, "fail")
    error = caught.value
    assert type(error) is error_class
    assert error.status_code == status
    assert error.type == error_type
    assert error.request_id == server.requests[0].request_id
    assert error.body == {
        "type": "error",
        "error": {"type": error_type, "message": error.api_message},
        "request_id": error.request_id,
    }
    assert classify_exception(error).retryable is (status in (408, 409, 429) or status >= 500)


async def test_retry_headers_are_readable_from_the_exception(
    server: ModelServer, client: anthropic.AsyncAnthropic
) -> None:
    date = "Wed, 21 Oct 2026 07:28:00 GMT"
    server.script(
        "slow down",
        [
            ErrorTurn(429, retry_after=7, retry_after_ms=1500, should_retry=True),
            ErrorTurn(529, retry_after=date, should_retry=False, message="Busy, come back later"),
        ],
    )
    with pytest.raises(anthropic.RateLimitError) as limited:
        await stream_text(client, "slow down")
    headers = limited.value.response.headers
    assert (headers["retry-after"], headers["retry-after-ms"]) == ("7", "1500")
    assert headers["x-should-retry"] == "true"
    failure = classify_exception(limited.value)
    assert (failure.code, failure.retryable, failure.retry_after) == (
        ProviderCode.RATE_LIMITED,
        True,
        1.5,
    )

    with pytest.raises(anthropic.OverloadedError) as overloaded:
        await stream_text(client, "slow down")
    assert overloaded.value.response.headers["retry-after"] == date
    assert overloaded.value.api_message == "Busy, come back later"
    assert classify_exception(overloaded.value).retryable is False  # x-should-retry: false


async def test_sdk_retries_a_529_and_the_log_shows_each_attempt(
    server: ModelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ANTHROPIC_CUSTOM_HEADERS", raising=False)
    # retry-after-ms keeps the SDK's wait at 10 ms instead of its 0.5 s first backoff.
    server.script("flaky", [ErrorTurn(529, retry_after_ms=10), TextTurn("recovered")])
    sdk = make_client(server.base_url, max_retries=2)
    try:
        assert await stream_text(sdk, "flaky") == "recovered"
    finally:
        await sdk.close()
    log = server.requests
    assert [r.headers["x-stainless-retry-count"] for r in log] == ["0", "1"]
    assert [r.outcome for r in log] == ["error_status", "ok"]
    assert [r.served for r in log] == ["script", "script"]


# Faults inside a started stream -----------------------------------------------------------------


async def test_mid_stream_error_raises_status_200_overloaded(
    server: ModelServer, client: anthropic.AsyncAnthropic
) -> None:
    server.script("overload me", [MidStreamError(after_events=5)])
    received: list[str] = []
    with pytest.raises(anthropic.APIStatusError) as caught:
        async with client.messages.stream(
            model="m", max_tokens=64, messages=ask("overload me")
        ) as stream:
            async for text in stream.text_stream:
                received.append(text)
    error = caught.value
    assert type(error) is anthropic.APIStatusError
    assert error.status_code == 200
    assert error.type == "overloaded_error"
    assert error.body == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "Overloaded"},
    }
    assert received  # text arrived before the error
    assert FAULT_BODY_TEXT.startswith("".join(received))
    failure = classify_exception(error)
    assert (failure.code, failure.retryable, failure.status) == (
        ProviderCode.OVERLOADED,
        True,
        200,
    )
    assert server.requests[0].outcome == "mid_stream_error"


async def test_cut_connection_raises_raw_remote_protocol_error(
    server: ModelServer, client: anthropic.AsyncAnthropic
) -> None:
    server.script("cut me", [Cut(after_events=4)])
    with pytest.raises(httpx2.RemoteProtocolError) as caught:
        await stream_text(client, "cut me")
    # The SDK does not wrap it: not an AnthropicError, so its own retry loop never sees it.
    assert not isinstance(caught.value, anthropic.AnthropicError)
    assert "incomplete chunked read" in str(caught.value)
    assert classify_exception(caught.value).code == ProviderCode.STREAM_CUT
    assert server.requests[0].outcome == "cut"


async def test_truncated_stream_ends_without_error_and_without_stop_reason(
    server: ModelServer, client: anthropic.AsyncAnthropic
) -> None:
    server.script("truncate me", [Truncated(after_events=5)])
    async with client.messages.stream(
        model="m", max_tokens=64, messages=ask("truncate me")
    ) as stream:
        message = await stream.get_final_message()
    assert message.stop_reason is None
    partial = message.content[0]
    assert partial.type == "text"
    assert FAULT_BODY_TEXT.startswith(partial.text)
    assert partial.text != FAULT_BODY_TEXT
    assert classify_exception(StreamIncomplete()).code == ProviderCode.STREAM_INCOMPLETE
    assert server.requests[0].outcome == "truncated"


async def test_stall_past_the_read_timeout_raises_raw_read_timeout(
    server: ModelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ANTHROPIC_CUSTOM_HEADERS", raising=False)
    server.script("stall", [Stall(after_events=4)])  # no end: until the client leaves
    sdk = make_client(server.base_url, timeout=httpx2.Timeout(10.0, read=0.3))
    try:
        with pytest.raises(httpx2.ReadTimeout) as caught:
            await stream_text(sdk, "stall")
    finally:
        await sdk.close()
    assert not isinstance(caught.value, anthropic.AnthropicError)
    assert classify_exception(caught.value).code == ProviderCode.TIMEOUT
    assert server.requests[0].headers["x-stainless-read-timeout"] == "0.3"
    # The SDK closes the response on the way out; the server sees the client go away.
    await wait_for_outcome(server, 0, "disconnected")


async def test_bounded_stall_then_the_stream_completes(
    server: ModelServer, client: anthropic.AsyncAnthropic
) -> None:
    server.script("pause", [Stall(after_events=3, seconds=0.05)])
    assert await stream_text(client, "pause") == FAULT_BODY_TEXT
    assert server.requests[0].outcome == "ok"


async def test_stop_ends_a_stall_that_never_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANTHROPIC_CUSTOM_HEADERS", raising=False)
    server = ModelServer()
    await server.start()
    sdk = make_client(server.base_url)
    try:
        server.script(None, [Stall(after_events=2)])
        reader = asyncio.create_task(stream_text(sdk, "anything"))
        await wait_for_outcome(server, 0, "pending")
        async with asyncio.timeout(WAIT):
            await server.stop()
            with pytest.raises(httpx2.RemoteProtocolError):
                await reader
        assert server.requests[0].outcome == "server_stopped"
    finally:
        await sdk.close()
        await server.stop()


# Script keys ------------------------------------------------------------------------------------


async def test_header_key_beats_prompt_key_and_demo_answers_the_rest(
    server: ModelServer, client: anthropic.AsyncAnthropic
) -> None:
    server.script("by-header", [TextTurn("from the header queue")])
    server.script("hello there", [TextTurn("from the prompt queue")])
    headed = await stream_text(
        client, "hello there", extra_headers={"x-tether-script": "by-header"}
    )
    assert headed == "from the header queue"
    assert await stream_text(client, "hello there") == "from the prompt queue"
    assert "hello there" in await stream_text(client, "hello there")  # queue empty: demo
    assert [r.served for r in server.requests] == ["script", "script", "demo"]
    assert [r.script_key for r in server.requests] == ["by-header", "hello there", "hello there"]


async def test_default_queue_catches_any_unscripted_request(
    server: ModelServer, client: anthropic.AsyncAnthropic
) -> None:
    server.script(None, [TextTurn("from the default queue")])
    assert await stream_text(client, "some prompt nobody scripted") == "from the default queue"
    assert server.pending() == 0


async def test_long_prompts_are_keyed_by_their_first_200_characters(
    server: ModelServer, client: anthropic.AsyncAnthropic
) -> None:
    prompt = "x" * 150 + " " + "y" * 150
    server.script(prompt[:200], [TextTurn("matched")])
    assert await stream_text(client, prompt) == "matched"


# The JSON script format -------------------------------------------------------------------------


async def outcome_of(client: anthropic.AsyncAnthropic, prompt: str) -> str:
    """A one-line summary of what the SDK made of the server's answer."""
    try:
        async with client.messages.stream(model="m", max_tokens=64, messages=ask(prompt)) as s:
            message = await s.get_final_message()
    except anthropic.APIStatusError as exc:
        return f"{type(exc).__name__} {exc.status_code} {exc.type}"
    except httpx2.TransportError as exc:
        return type(exc).__name__
    blocks = ",".join(block.type for block in message.content)
    return f"{blocks} {message.stop_reason}"


@pytest.mark.parametrize(
    ("turn", "expected"),
    [
        ({"kind": "text", "text": "hi"}, "text end_turn"),
        ({"kind": "text", "text": "hi", "stop_reason": "max_tokens"}, "text max_tokens"),
        ({"kind": "tool_use", "name": "get_time", "input": {}}, "tool_use tool_use"),
        ({"kind": "tool_use", "name": "t", "text": "First:"}, "text,tool_use tool_use"),
        (
            {
                "kind": "blocks",
                "blocks": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "ok"},
                    {"type": "tool_use", "name": "a", "input": {"x": 1}},
                    {"type": "tool_use", "name": "b", "input": {"y": 2}},
                ],
            },
            "thinking,text,tool_use,tool_use tool_use",
        ),
        ({"kind": "error", "status": 529}, "OverloadedError 529 overloaded_error"),
        (
            {"kind": "error", "status": 500, "type": "overloaded_error", "retry_after_ms": 5},
            "InternalServerError 500 overloaded_error",
        ),
        (
            {"kind": "mid_stream_error", "after_events": 3, "type": "api_error"},
            "APIStatusError 200 api_error",
        ),
        ({"kind": "stall", "after_events": 3, "seconds": 0.01, "delay_ms": 1}, "text end_turn"),
        ({"kind": "cut", "after_events": 3}, "RemoteProtocolError"),
        ({"kind": "truncated", "after_events": 3}, "text None"),
        (
            {"kind": "text", "text": "a b c d", "fault": {"kind": "truncated", "after_events": 4}},
            "text None",
        ),
    ],
)
async def test_json_turns_posted_to_the_control_api(
    server: ModelServer,
    client: anthropic.AsyncAnthropic,
    http: httpx2.AsyncClient,
    turn: dict[str, Any],
    expected: str,
) -> None:
    queued = await http.post("/_script", json={"key": "json", "turns": [turn]})
    assert queued.json() == {"key": "json", "queued": 1, "pending": 1}
    assert await outcome_of(client, "json") == expected


async def test_malformed_script_is_rejected(server: ModelServer, http: httpx2.AsyncClient) -> None:
    for payload in (
        {"turns": [{"kind": "nonsense"}]},
        {"turns": [{"kind": "text"}]},
        {"turns": [{"kind": "error", "status": "soon"}]},
        {"turns": [{"kind": "text", "text": "abc", "chunks": ["ab"]}]},
        {"key": "k"},
    ):
        response = await http.post("/_script", json=payload)
        assert response.status_code == 400, payload
        assert response.json()["error"]
    assert server.pending() == 0


# Out of process ---------------------------------------------------------------------------------


async def test_control_api_drives_a_separate_process() -> None:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("ANTHROPIC_CUSTOM_HEADERS", "ANTHROPIC_BASE_URL")
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(LIBS_DIR), env.get("PYTHONPATH")]))
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tether.testing.model_server",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        assert process.stdout is not None
        async with asyncio.timeout(30):
            line = (await process.stdout.readline()).decode()
        announced = re.fullmatch(r"model-server listening (http://127\.0\.0\.1:\d+)\n", line)
        assert announced, line
        base_url = announced.group(1)
        async with httpx2.AsyncClient(base_url=base_url) as http:
            turns = [
                {"kind": "error", "status": 529, "retry_after_ms": 10},
                {
                    "kind": "tool_use",
                    "name": "read_file",
                    "input": {"path": "a.py"},
                    "text": "On it.",
                },
            ]
            scripted = await http.post("/_script", json={"key": "remote", "turns": turns})
            assert scripted.status_code == 200

            sdk = make_client(base_url, max_retries=1)
            try:
                message = await sdk.messages.create(
                    model="claude-test",
                    max_tokens=32,
                    messages=ask("read a.py"),
                    extra_headers={"x-tether-script": "remote"},
                )
            finally:
                await sdk.close()
            assert message.content[1].input == {"path": "a.py"}

            log = (await http.get("/_requests")).json()["requests"]
            assert [entry["headers"]["x-stainless-retry-count"] for entry in log] == ["0", "1"]
            assert [entry["outcome"] for entry in log] == ["error_status", "ok"]
            first = log[0]
            assert (first["method"], first["path"], first["auth"]) == (
                "POST",
                "/v1/messages",
                "bearer",
            )
            assert first["headers"]["x-tether-script"] == "remote"
            assert first["body"]["messages"] == ask("read a.py")
            assert first["body"]["model"] == "claude-test"
            assert isinstance(first["timestamp"], float)

            assert (await http.post("/_reset")).json() == {"ok": True}
            assert (await http.get("/_requests")).json() == {"requests": []}
    finally:
        if process.returncode is None:
            process.terminate()
        await process.communicate()
    assert process.returncode == 0  # SIGTERM is a clean shutdown


# The demo agent ---------------------------------------------------------------------------------


def tool(name: str) -> dict[str, Any]:
    return {"name": name, "input_schema": {"type": "object", "properties": {}}}


ALL_TOOLS = [tool(n) for n in ("get_time", "publish_post", "ask_questions", "calendar_list_events")]


async def test_demo_agent_answers_in_several_text_deltas(
    server: ModelServer, client: anthropic.AsyncAnthropic
) -> None:
    deltas: list[str] = []
    async with client.messages.stream(
        model="m", max_tokens=256, messages=ask("Hello, who are you?")
    ) as stream:
        async for text in stream.text_stream:
            deltas.append(text)
        message = await stream.get_final_message()
    assert len(deltas) >= 3
    assert "Hello, who are you?" in "".join(deltas)
    assert message.stop_reason == "end_turn"
    assert message.usage.output_tokens > 0
    assert server.requests[0].served == "demo"


async def test_demo_agent_calls_get_time_then_summarises_the_result(
    client: anthropic.AsyncAnthropic,
) -> None:
    history: list[Any] = ask("What time is it?")
    first = await client.messages.create(
        model="m", max_tokens=256, messages=history, tools=[tool("get_time")]
    )
    assert first.stop_reason == "tool_use"
    preamble, call = first.content
    assert preamble.type == "text"
    assert call.type == "tool_use"
    assert (call.name, call.input) == ("get_time", {})

    history += [
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "2026-11-30T12:00:00Z"}
            ],
        },
    ]
    async with client.messages.stream(
        model="m", max_tokens=256, messages=history, tools=[tool("get_time")]
    ) as stream:
        second = await stream.get_final_message()
    assert second.stop_reason == "end_turn"
    summary = second.content[0]
    assert summary.type == "text"
    assert "get_time" in summary.text
    assert "2026-11-30T12:00:00Z" in summary.text


async def test_demo_agent_only_calls_offered_tools(client: anthropic.AsyncAnthropic) -> None:
    message = await client.messages.create(
        model="m", max_tokens=256, messages=ask("What time is it?"), tools=[tool("publish_post")]
    )
    assert [block.type for block in message.content] == ["text"]
    assert message.stop_reason == "end_turn"


@pytest.mark.parametrize(
    ("prompt", "name", "check"),
    [
        ("Please publish Hello world", "publish_post", lambda i: i == {"text": "Hello world"}),
        ("Check the clock", "get_time", lambda i: i == {}),
        ("What is on my calendar?", "calendar_list_events", lambda i: i == {}),
        (
            "Plan the trip but ask me first",
            "ask_questions",
            lambda i: len(i["questions"]) == 1 and i["questions"][0]["prompt"],
        ),
    ],
)
async def test_demo_agent_intents(
    client: anthropic.AsyncAnthropic,
    prompt: str,
    name: str,
    check: Callable[[Any], bool],
) -> None:
    message = await client.messages.create(
        model="m", max_tokens=256, messages=ask(prompt), tools=ALL_TOOLS
    )
    call = message.content[-1]
    assert call.type == "tool_use"
    assert call.name == name
    assert check(call.input)


async def test_demo_agent_is_deterministic(client: anthropic.AsyncAnthropic) -> None:
    async def once() -> tuple[Any, ...]:
        message = await client.messages.create(
            model="m", max_tokens=256, messages=ask("time please"), tools=ALL_TOOLS
        )
        return (
            [block.model_dump() for block in message.content],
            message.usage.input_tokens,
            message.usage.output_tokens,
        )

    assert await once() == await once()


async def test_the_prompt_cache_is_reported_through_the_sdk(
    server: ModelServer, client: anthropic.AsyncAnthropic
) -> None:
    system = [{"type": "text", "text": "x" * 4_400, "cache_control": {"type": "ephemeral"}}]

    async def usage() -> Any:
        async with client.messages.stream(
            model="claude-sonnet-5-5", max_tokens=64, system=system, messages=ask("cache me")
        ) as stream:
            return (await stream.get_final_message()).usage

    first, second = await usage(), await usage()
    assert first.cache_creation_input_tokens > 0 and first.cache_read_input_tokens == 0
    assert first.cache_creation.ephemeral_5m_input_tokens == first.cache_creation_input_tokens
    assert second.cache_read_input_tokens == first.cache_creation_input_tokens
    assert second.cache_creation_input_tokens == 0
    assert [r.usage["cache_read_input_tokens"] for r in server.requests] == [
        0,
        second.cache_read_input_tokens,
    ]
    marked = [
        {"type": "text", "text": str(i), "cache_control": {"type": "ephemeral"}} for i in range(5)
    ]
    with pytest.raises(anthropic.BadRequestError, match="A maximum of 4 blocks"):
        await client.messages.create(
            model="claude-sonnet-5-5", max_tokens=8, system=marked, messages=ask("five")
        )
