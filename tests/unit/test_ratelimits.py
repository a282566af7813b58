"""Shared model rate limits: the bucket arithmetic (tether.ratelimits) and the orchestrator's
grants from memory (services/orchestrator/rate_limits.ModelLimits), on a hand clock."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from services.orchestrator.model_limit_edge import UNLIMITED_RESERVATION, model_limit_writes
from services.orchestrator.rate_limits import ModelLimits
from tether.errors import InvalidArgument
from tether.ratelimits import Headers, Limit, credential_id, limit_for, parse_model_limits
from tether.v1 import orchestrator_pb2


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def limits(clock: Clock, text: str, share: float = 1.0) -> ModelLimits:
    return ModelLimits(parse_model_limits(text), share=share, clock=clock)


def test_parse_reads_entries_and_names_the_bad_one() -> None:
    parsed = parse_model_limits(
        "claude-sonnet-5-5: requests=50, input_tokens=30000, output_tokens=8000;"
        " cred-abc/*: requests=5, window=2; *:"
    )
    assert parsed[("*", "claude-sonnet-5-5")] == Limit(50, 30_000, 8_000, 60.0)
    assert parsed[("cred-abc", "*")] == Limit(requests=5, window_s=2.0)
    assert limit_for(parsed, "cred-abc", "claude-haiku") == Limit(requests=5, window_s=2.0)
    assert limit_for(parsed, "cred-x", "claude-sonnet-5-5").requests == 50
    assert limit_for(parsed, "cred-x", "other") == Limit()
    with pytest.raises(InvalidArgument, match="rpm=5"):
        parse_model_limits("m: rpm=5")
    with pytest.raises(InvalidArgument, match="requests must be a positive number"):
        parse_model_limits("m: requests=-1")
    with pytest.raises(InvalidArgument, match="MODEL"):
        parse_model_limits("no colon here")


def test_reserve_takes_all_three_or_nothing_and_says_when_it_fits() -> None:
    clock = Clock()
    grants = limits(clock, "m: requests=10, input_tokens=1000, output_tokens=600, window=10")
    first, wait = grants.reserve("r1", 1, "c", "m", 700, 300)
    assert first and wait == 0
    refused, wait = grants.reserve("r2", 1, "c", "m", 400, 100)
    # 100 input tokens short at 100 tokens/s: one second.
    assert refused == 0 and wait == pytest.approx(1.0)
    assert grants.buckets("c", "m").levels() == {
        "requests": pytest.approx(9),
        "input_tokens": pytest.approx(300),
        "output_tokens": pytest.approx(300),
    }
    clock.now += 1.0
    granted, wait = grants.reserve("r2", 1, "c", "m", 400, 100)
    assert granted and wait == 0


def test_reconcile_gives_back_the_unused_and_takes_the_overrun() -> None:
    clock = Clock()
    grants = limits(clock, "m: input_tokens=1000, output_tokens=1000, window=60")
    held, _ = grants.reserve("r1", 1, "c", "m", 500, 400)
    grants.settle(held, "c", "m", {"input_tokens": 550, "output_tokens": 100}, Headers())
    levels = grants.buckets("c", "m").levels()
    assert levels["input_tokens"] == pytest.approx(450)  # 50 over the estimate, taken
    assert levels["output_tokens"] == pytest.approx(900)  # 300 of max_tokens unused, back
    assert grants.outstanding == 0


def test_refill_is_continuous_and_stops_at_the_limit() -> None:
    clock = Clock()
    grants = limits(clock, "m: output_tokens=600, window=60")
    grants.reserve("r1", 1, "c", "m", 0, 600)
    clock.now += 30
    assert grants.buckets("c", "m").levels()["output_tokens"] == pytest.approx(0)
    grants.buckets("c", "m").refill(clock.now)
    assert grants.buckets("c", "m").levels()["output_tokens"] == pytest.approx(300)
    clock.now += 600
    grants.buckets("c", "m").refill(clock.now)
    assert grants.buckets("c", "m").levels()["output_tokens"] == pytest.approx(600)


def test_let_go_returns_a_dead_workers_tokens_but_not_its_request() -> None:
    clock = Clock()
    grants = limits(clock, "m: requests=5, input_tokens=1000, window=60")
    grants.reserve("r1", 1, "c", "m", 800, 0)
    assert grants.let_go("r1") == 1
    levels = grants.buckets("c", "m").levels()
    assert levels["input_tokens"] == pytest.approx(1000)
    assert levels["requests"] == pytest.approx(4)
    assert grants.let_go("r1") == 0  # once


def test_headers_teach_an_unconfigured_bucket_and_lower_a_configured_one() -> None:
    clock = Clock()
    grants = limits(clock, "m: input_tokens=5000, window=60; *:")
    headers = Headers.read(
        {
            "anthropic-ratelimit-requests-limit": "50",
            "anthropic-ratelimit-requests-remaining": "20",
            "anthropic-ratelimit-input-tokens-limit": "4000",
            "anthropic-ratelimit-input-tokens-remaining": "1000",
            "Anthropic-RateLimit-Output-Tokens-Limit": "8000",
        }
    )
    grants.settle(0, "c", "m", None, headers)
    buckets = grants.buckets("c", "m")
    assert buckets.levels()["requests"] == pytest.approx(20)
    assert buckets.buckets["input_tokens"] is not None
    assert buckets.buckets["input_tokens"].capacity == 4000  # below the operator's 5000
    assert buckets.levels()["input_tokens"] == pytest.approx(1000)
    assert buckets.levels()["output_tokens"] == pytest.approx(8000)
    # A provider limit above the operator's never raises it.
    grants.settle(
        0, "c", "m", None, Headers.read({"anthropic-ratelimit-input-tokens-limit": "9000"})
    )
    assert buckets.buckets["input_tokens"].capacity == 5000


def test_a_429_shrinks_the_bucket_to_what_its_headers_said() -> None:
    clock = Clock()
    grants = limits(clock, "m: requests=60, input_tokens=6000, window=60")
    headers = Headers.read(
        {
            "retry-after": "5",
            "anthropic-ratelimit-input-tokens-remaining": "0",
            "anthropic-ratelimit-requests-remaining": "40",
        }
    )
    grants.settle(0, "c", "m", None, headers)
    levels = grants.buckets("c", "m").levels()
    assert levels["requests"] == pytest.approx(40)
    # Empty until retry-after has passed: 5 s at 100 tokens/s below zero.
    assert levels["input_tokens"] == pytest.approx(-500)
    _, wait = grants.reserve("r", 1, "c", "m", 100, 0)
    assert wait == pytest.approx(6.0)


def test_a_replicas_share_scales_its_limits_and_what_the_provider_says() -> None:
    clock = Clock()
    grants = limits(clock, "m: requests=100, window=60; *:", share=0.5)
    assert grants.buckets("c", "m").levels()["requests"] == pytest.approx(50)
    said = Headers.read({"anthropic-ratelimit-requests-remaining": "30"})
    grants.settle(0, "c", "m", None, said)
    assert grants.buckets("c", "m").levels()["requests"] == pytest.approx(15)
    with pytest.raises(InvalidArgument):
        ModelLimits(share=0)


def test_unlimited_until_named_and_credentials_are_digests() -> None:
    grants = limits(Clock(), "")
    assert grants.reserve("r", 1, "c", "m", 10**9, 10**9)[0]
    assert credential_id("sk-secret").startswith("cred-")
    assert "sk-secret" not in credential_id("sk-secret")


def test_the_reset_time_teaches_the_refill_rate() -> None:
    clock = Clock()
    grants = limits(clock, "*:")
    now = datetime(2026, 1, 1, tzinfo=UTC)
    headers = Headers.read(
        {
            "anthropic-ratelimit-requests-limit": "10",
            "anthropic-ratelimit-requests-remaining": "5",
            # Half empty and full again in 1 s: the whole bucket refills in 2 s.
            "anthropic-ratelimit-requests-reset": "2026-01-01T00:00:01.000Z",
        },
        now=now,
    )
    grants.settle(0, "c", "m", None, headers)
    bucket = grants.buckets("c", "m").buckets["requests"]
    assert bucket is not None and bucket.window_s == pytest.approx(2.0)
    assert bucket.level == pytest.approx(5)
    clock.now += 0.5
    bucket.refill(clock.now)
    assert bucket.level == pytest.approx(7.5)


def test_a_refusal_while_calls_are_in_flight_waits_at_most_the_recheck() -> None:
    clock = Clock()
    grants = ModelLimits(parse_model_limits("m: output_tokens=1000, window=600"), clock=clock)
    held, _ = grants.reserve("r1", 1, "c", "m", 0, 700)
    _, wait = grants.reserve("r2", 1, "c", "m", 0, 700)
    assert wait == pytest.approx(1.0)  # r1 will give back what it does not use
    grants.settle(held, "c", "m", {"input_tokens": 0, "output_tokens": 10}, Headers())
    assert grants.reserve("r2", 1, "c", "m", 0, 700)[0]
    _, wait = grants.reserve("r3", 1, "c", "m", 0, 700)
    assert wait == pytest.approx(1.0)
    grants.let_go("r2")
    clock.now += 3.5  # r3 did not come back within its wait and two rechecks: its place lapses
    spent, _ = grants.reserve("r4", 1, "c", "m", 0, 990)
    grants.settle(spent, "c", "m", {"input_tokens": 0, "output_tokens": 990}, Headers())
    # Nothing in flight: the wait is the refill's, 700 tokens (less the few refilled in those
    # 3.5 s) at 1000 per 600 s.
    _, wait = grants.reserve("r5", 1, "c", "m", 0, 700)
    assert wait == pytest.approx(420.0 - 3.5)


def test_a_refused_run_keeps_its_place_ahead_of_calls_asking_after_it() -> None:
    clock = Clock()
    grants = ModelLimits(parse_model_limits("m: requests=2, window=2"), clock=clock)
    assert grants.reserve("r1", 1, "c", "m", 0, 0)[0]
    assert grants.reserve("r2", 1, "c", "m", 0, 0)[0]
    _, first_wait = grants.reserve("r3", 1, "c", "m", 0, 0)
    assert first_wait == pytest.approx(1.0)
    assert grants.leases_held_for() == pytest.approx(1.0)
    clock.now += 1.0  # room for one call: r3's, though r4 asks first
    _, wait = grants.reserve("r4", 1, "c", "m", 0, 0)
    assert wait == pytest.approx(1.0)  # behind r3: until the buckets hold both
    assert grants.reserve("r3", 2, "c", "m", 0, 0)[0]
    clock.now += 1.0
    assert grants.reserve("r4", 2, "c", "m", 0, 0)[0]
    assert grants.leases_held_for() == 0.0


def test_leases_are_held_until_the_first_refused_call_fits_not_while_those_behind_it_wait() -> None:
    """The hold keeps new leases from taking the room the first refused call waits for, until
    that call fits; the calls refused behind it (rechecking every second) do not stretch it:
    each second a refill could serve went unused while they did (the fairness bench's
    utilisation at 80-97 %, refused runs coming back once a second at 600 tokens a second for
    calls of 496)."""
    clock = Clock()
    grants = ModelLimits(parse_model_limits("m: input_tokens=600, window=1"), clock=clock)
    assert grants.reserve("r1", 1, "c", "m", 500, 0)[0]  # 100 left, r1 in flight
    _, first = grants.reserve("r2", 1, "c", "m", 500, 0)
    assert first == pytest.approx(400 / 600)
    _, behind = grants.reserve("r3", 1, "c", "m", 500, 0)
    assert behind == pytest.approx(1.0)  # behind r2 (900 to wait for), rechecked each second
    assert grants.leases_held_for() == pytest.approx(first)
    clock.now += first + 0.001
    assert grants.leases_held_for() == 0.0
    assert grants.reserve("r2", 2, "c", "m", 500, 0)[0]  # back then, it fits


async def test_a_replica_keeping_no_limits_grants_a_re_sent_reservation() -> None:
    writes = model_limit_writes(None)
    request = orchestrator_pb2.ReserveModelRequest(run_id="r", epoch=1, model="m")
    answer = await writes[orchestrator_pb2.ReserveModelRequest](request)
    assert isinstance(answer, orchestrator_pb2.ReserveModelResponse)
    assert answer.reservation_id == UNLIMITED_RESERVATION and answer.wait_ms == 0
    kept = model_limit_writes(limits(Clock(), "m: requests=1"))
    reserve = kept[orchestrator_pb2.ReserveModelRequest]
    granted = await reserve(request)
    refused = await reserve(request)
    assert isinstance(granted, orchestrator_pb2.ReserveModelResponse)
    assert isinstance(refused, orchestrator_pb2.ReserveModelResponse)
    assert granted.reservation_id == 1 and refused.reservation_id == 0 and refused.wait_ms > 0


def test_a_learned_window_never_refills_a_configured_bucket_faster_than_its_operator_said() -> None:
    clock = Clock()
    grants = limits(clock, "m: requests=10, window=2")
    now = datetime(2026, 1, 1, tzinfo=UTC)
    headers = Headers.read(
        {
            "anthropic-ratelimit-requests-limit": "10",
            "anthropic-ratelimit-requests-remaining": "5",
            # Half empty and full in 0.5 s: a 1 s window, faster than the operator's 2 s.
            "anthropic-ratelimit-requests-reset": "2026-01-01T00:00:00.500Z",
        },
        now=now,
    )
    grants.settle(0, "c", "m", None, headers)
    bucket = grants.buckets("c", "m").buckets["requests"]
    assert bucket is not None and bucket.window_s == pytest.approx(2.0)


async def test_a_settlement_reads_the_reset_times_as_of_when_the_headers_arrived() -> None:
    clock = Clock()
    grants = limits(clock, "*:")
    reset = datetime.now(UTC) + timedelta(seconds=0.5)
    settle = model_limit_writes(grants)[orchestrator_pb2.SettleModelRequest]
    # Half empty, full 1.5 s after the headers arrived (so a 3 s window); settled 1 s later,
    # at the end of the call's stream.
    await settle(
        orchestrator_pb2.SettleModelRequest(
            model="m",
            credential_id="c",
            headers={
                "anthropic-ratelimit-requests-limit": "10",
                "anthropic-ratelimit-requests-remaining": "5",
                "anthropic-ratelimit-requests-reset": reset.isoformat().replace("+00:00", "Z"),
            },
            headers_age_s=1.0,
        )
    )
    bucket = grants.buckets("c", "m").buckets["requests"]
    # Read as of now, the 0.5 s left would have taught a 1 s window: refills 3 times too fast.
    assert bucket is not None and bucket.window_s == pytest.approx(3.0, rel=0.05)
