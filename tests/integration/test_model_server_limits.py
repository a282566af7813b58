"""The local model server's rate limiter against the real `anthropic` SDK: the
`anthropic-ratelimit-*` headers on every answer, 429 `rate_limit_error` with `retry-after`, refill
over a short window, buckets per API key, and off by default."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime

import anthropic
import pytest

from tether.testing.model_server import ModelServer, RateLimits, TextTurn, Usage


def client(server: ModelServer, key: str = "test") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=server.base_url, api_key=key, max_retries=0)


async def ask(sdk: anthropic.AsyncAnthropic, max_tokens: int = 100) -> anthropic.APIResponse:  # type: ignore[type-arg]
    return await sdk.messages.with_raw_response.create(
        model="claude-sonnet-5-5",
        max_tokens=max_tokens,
        messages=[{"role": "user", "content": "hello there"}],
    )


async def test_every_answer_carries_the_headers_and_the_buckets_count_down() -> None:
    limits = RateLimits(requests=5, input_tokens=10_000, output_tokens=1_000, window=60)
    async with ModelServer(limits=limits) as server:
        server.script(None, [TextTurn("hi", usage=Usage(input_tokens=10, output_tokens=7))] * 2)
        sdk = client(server)
        first = await ask(sdk, max_tokens=300)
        second = await ask(sdk, max_tokens=300)
    for name in ("requests", "input-tokens", "output-tokens", "tokens"):
        for part in ("limit", "remaining", "reset"):
            assert f"anthropic-ratelimit-{name}-{part}" in first.headers
    assert first.headers["anthropic-ratelimit-requests-limit"] == "5"
    assert first.headers["anthropic-ratelimit-requests-remaining"] == "4"
    assert second.headers["anthropic-ratelimit-requests-remaining"] == "3"
    # max_tokens is taken at admission; the unused part came back when the first answer ended.
    assert int(first.headers["anthropic-ratelimit-output-tokens-remaining"]) == 700
    assert 690 <= int(second.headers["anthropic-ratelimit-output-tokens-remaining"]) <= 693 + 1
    reset = datetime.fromisoformat(second.headers["anthropic-ratelimit-requests-reset"])
    assert 0 < reset.timestamp() - time.time() <= 60
    assert int(first.headers["anthropic-ratelimit-input-tokens-remaining"]) < 10_000


async def test_past_the_limit_the_answer_is_429_rate_limit_error_with_retry_after() -> None:
    async with ModelServer(limits=RateLimits(requests=2, window=30)) as server:
        sdk = client(server)
        await ask(sdk)
        await ask(sdk)
        with pytest.raises(anthropic.RateLimitError) as refused:
            await ask(sdk)
        log = server.requests
    error = refused.value
    assert error.status_code == 429
    assert isinstance(error.body, dict) and error.body["error"]["type"] == "rate_limit_error"
    assert 1 <= int(error.response.headers["retry-after"]) <= 15
    assert error.response.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert [r.served for r in log] == ["demo", "demo", "rate_limited"]


async def test_output_tokens_refuse_a_max_tokens_the_bucket_cannot_hold_then_refill() -> None:
    limits = RateLimits(output_tokens=1_000, window=1.0)
    async with ModelServer(limits=limits) as server:
        server.script(None, [TextTurn("x", usage=Usage(input_tokens=10, output_tokens=900))] * 3)
        sdk = client(server)
        await ask(sdk, max_tokens=900)  # 100 left until it refills at 1000/s
        with pytest.raises(anthropic.RateLimitError):
            await ask(sdk, max_tokens=900)
        deadline = time.monotonic() + 5
        while True:  # the bucket refills within its window
            try:
                await ask(sdk, max_tokens=900)
                break
            except anthropic.RateLimitError:
                assert time.monotonic() < deadline, "the bucket never refilled"
                await asyncio.sleep(0.05)


async def test_buckets_are_per_api_key() -> None:
    async with ModelServer(limits=RateLimits(requests=1, window=60)) as server:
        await ask(client(server, "key-a"))
        with pytest.raises(anthropic.RateLimitError):
            await ask(client(server, "key-a"))
        await ask(client(server, "key-b"))


async def test_off_by_default_no_headers_and_no_refusal() -> None:
    async with ModelServer() as server:
        sdk = client(server)
        answers = [await ask(sdk) for _ in range(5)]
    assert not any(h.startswith("anthropic-ratelimit") for h in answers[-1].headers)


async def test_streamed_answers_carry_the_headers_too() -> None:
    async with ModelServer(limits=RateLimits(requests=3, window=60)) as server:
        sdk = client(server)
        async with sdk.messages.with_streaming_response.create(
            model="claude-sonnet-5-5",
            max_tokens=50,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
        ) as streamed:
            await streamed.read()
            assert streamed.headers["anthropic-ratelimit-requests-remaining"] == "2"
