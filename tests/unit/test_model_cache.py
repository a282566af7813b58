"""The local model server's prompt cache follows the Messages API's rules: at most four
breakpoints; a prefix is cached at a breakpoint only from 1,024 tokens (2,048 for the smallest
models); a later request reads the longest cached prefix ending within 20 blocks before one of
its breakpoints; an entry lives five minutes (an hour on request), each hit starting it again."""

from __future__ import annotations

from typing import Any

import pytest

from tether.testing.model_cache import (
    LOOKBACK_BLOCKS,
    CacheRequestError,
    PromptCache,
    blocks_of,
    input_tokens_for,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def text(words: str, *, mark: str | None = None) -> dict[str, Any]:
    block: dict[str, Any] = {"type": "text", "text": words}
    if mark is not None:
        block["cache_control"] = {"type": "ephemeral"} | ({"ttl": mark} if mark == "1h" else {})
    return block


BIG = "x" * 4_400  # about 1,100 tokens: cacheable for most models, not the smallest


def body(
    *,
    system_mark: str | None = "5m",
    model: str = "claude-sonnet-5-5",
    turns: int = 1,
    **extra: Any,
) -> dict[str, Any]:
    messages = []
    for i in range(turns):
        messages += [
            {"role": "user", "content": [text(f"question {i}")]},
            {"role": "assistant", "content": [text(f"answer {i}")]},
        ]
    messages.append({"role": "user", "content": [text("now?")]})
    return {
        "model": model,
        "max_tokens": 10,
        "system": [text(BIG, mark=system_mark)],
        "messages": messages,
        **extra,
    }


def mark_last(request: dict[str, Any], index: int, ttl: str = "5m") -> dict[str, Any]:
    """Put a breakpoint on the last block of message `index`."""
    block = request["messages"][index]["content"][-1]
    block["cache_control"] = {"type": "ephemeral"} | ({"ttl": ttl} if ttl == "1h" else {})
    return request


def test_no_breakpoint_caches_nothing() -> None:
    cache = PromptCache(Clock())
    first = cache.account(body(system_mark=None))
    again = cache.account(body(system_mark=None))
    assert first == again
    assert first.cache_read_input_tokens == first.cache_creation_input_tokens == 0
    assert first.input_tokens == input_tokens_for(body(system_mark=None))


def test_a_long_enough_prefix_is_written_once_then_read() -> None:
    cache = PromptCache(Clock())
    first = cache.account(body())
    prefix = blocks_of(body())[0].tokens
    assert prefix >= 1024
    assert (first.cache_creation_input_tokens, first.cache_read_input_tokens) == (prefix, 0)
    assert first.ephemeral_5m_input_tokens == prefix
    again = cache.account(body())
    assert (again.cache_creation_input_tokens, again.cache_read_input_tokens) == (0, prefix)
    assert again.input_tokens == input_tokens_for(body()) - prefix


def test_the_smallest_models_need_twice_as_long_a_prefix() -> None:
    cache = PromptCache(Clock())
    for _ in range(2):
        small = cache.account(body(model="claude-haiku-5-5"))
        assert small.cache_creation_input_tokens == small.cache_read_input_tokens == 0


def test_a_short_prefix_is_not_cached() -> None:
    cache = PromptCache(Clock())
    short = {
        "model": "m",
        "max_tokens": 1,
        "system": [text("brief", mark="5m")],
        "messages": [{"role": "user", "content": "hi"}],
    }
    for _ in range(2):
        assert cache.account(short).cache_read_input_tokens == 0


def test_a_changed_byte_or_another_model_misses() -> None:
    cache = PromptCache(Clock())
    cache.account(body())
    changed = body()
    changed["system"][0]["text"] = BIG[:-1] + "y"
    assert cache.account(changed).cache_read_input_tokens == 0
    assert cache.account(body(model="claude-opus-5-5")).cache_read_input_tokens == 0
    # The breakpoint marker itself is not part of the prefix.
    moved = body()
    moved["system"][0]["cache_control"] = {"type": "ephemeral"}
    assert cache.account(moved).cache_read_input_tokens > 0


def test_a_later_breakpoint_reads_an_earlier_prefix_within_the_lookback() -> None:
    cache = PromptCache(Clock())
    first = mark_last(body(turns=3), 5)  # breakpoint on the last answer
    written = cache.account(first)
    assert written.cache_creation_input_tokens == sum(b.tokens for b in blocks_of(first)[:-1])
    grown = mark_last(body(turns=6), 11)  # the same history and more: breakpoint moved on
    read = cache.account(grown)
    assert read.cache_read_input_tokens == written.cache_creation_input_tokens
    # A breakpoint more than 20 blocks past the cached prefix does not see it.
    far = mark_last(body(turns=3 + LOOKBACK_BLOCKS), 5 + 2 * LOOKBACK_BLOCKS)
    far["system"][0].pop("cache_control")
    fresh = PromptCache(Clock())
    fresh.account(first)
    assert fresh.account(far).cache_read_input_tokens == 0


def test_an_entry_lives_five_minutes_each_hit_starting_it_again() -> None:
    clock = Clock()
    cache = PromptCache(clock)
    cache.account(body())
    clock.now += 200
    assert cache.account(body()).cache_read_input_tokens > 0  # hit: lives to +500
    clock.now += 250
    assert cache.account(body()).cache_read_input_tokens > 0  # +450: still there
    clock.now += 301
    assert cache.account(body()).cache_read_input_tokens == 0  # expired: written again
    assert cache.account(body()).cache_read_input_tokens > 0


def test_an_hour_on_request() -> None:
    clock = Clock()
    cache = PromptCache(clock)
    written = cache.account(body(system_mark="1h"))
    assert written.ephemeral_1h_input_tokens == written.cache_creation_input_tokens > 0
    clock.now += 3000
    assert cache.account(body(system_mark="1h")).cache_read_input_tokens > 0


def test_the_breakpoint_rules_are_the_apis() -> None:
    five = mark_last(mark_last(mark_last(mark_last(body(turns=2), 0), 1), 2), 3)
    with pytest.raises(CacheRequestError, match="A maximum of 4 blocks with cache_control"):
        PromptCache(Clock()).account(five)
    late_hour = mark_last(body(turns=1), 1, ttl="1h")  # 1h after the system's 5m
    with pytest.raises(CacheRequestError, match="must not come after"):
        PromptCache(Clock()).account(late_hour)
