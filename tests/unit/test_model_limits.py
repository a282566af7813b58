"""The local model server's token buckets (tether.testing.model_limits), on a hand clock."""

from __future__ import annotations

import pytest

from tether.testing.model_limits import ModelRateLimiter, RateLimitFormatError, RateLimits


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_take_refuses_with_the_wait_until_it_fits_and_takes_nothing() -> None:
    clock = Clock()
    limiter = ModelRateLimiter(RateLimits(requests=2, input_tokens=100, window=10), clock)
    assert limiter.try_take("k", 60, 0) is None
    assert limiter.try_take("k", 60, 0) == pytest.approx(2.0)  # 20 missing at 10 tokens/s
    assert limiter.remaining("k")["requests"] == pytest.approx(1)
    clock.now += 2
    assert limiter.try_take("k", 60, 0) is None
    assert limiter.remaining("k")["input_tokens"] == pytest.approx(0)


def test_refill_stops_at_capacity_and_unused_output_comes_back() -> None:
    clock = Clock()
    limiter = ModelRateLimiter(RateLimits(output_tokens=1000, window=1), clock)
    assert limiter.try_take("k", 0, 800) is None
    limiter.give_back_output("k", 700)
    assert limiter.remaining("k")["output_tokens"] == pytest.approx(900)
    clock.now += 60
    assert limiter.remaining("k")["output_tokens"] == pytest.approx(1000)
    assert limiter.remaining("k")["requests"] is None


def test_the_headers_say_limit_remaining_and_when_full() -> None:
    clock = Clock()
    limiter = ModelRateLimiter(
        RateLimits(requests=10, input_tokens=100, output_tokens=50, window=10),
        clock,
        wall=lambda: 1_700_000_000.0,
    )
    limiter.try_take("k", 40, 10)
    headers = limiter.headers("k")
    assert headers["anthropic-ratelimit-requests-remaining"] == "9"
    assert headers["anthropic-ratelimit-input-tokens-remaining"] == "60"
    assert headers["anthropic-ratelimit-tokens-limit"] == "150"
    assert headers["anthropic-ratelimit-tokens-remaining"] == "100"
    # 40 input tokens at 10/s: full again in 4 s.
    assert headers["anthropic-ratelimit-input-tokens-reset"] == "2023-11-14T22:13:24.000Z"


def test_parse_reads_the_flag_and_names_the_bad_part() -> None:
    parsed = RateLimits.parse("requests=50, input_tokens=40000,output-tokens=8000,window=2.5")
    assert parsed == RateLimits(50, 40_000, 8_000, 2.5)
    with pytest.raises(RateLimitFormatError, match="tokens=1"):
        RateLimits.parse("tokens=1")
    with pytest.raises(RateLimitFormatError, match="'many' is not a number"):
        RateLimits.parse("requests=many")
    with pytest.raises(RateLimitFormatError, match="window"):
        RateLimits.parse("window=0")
