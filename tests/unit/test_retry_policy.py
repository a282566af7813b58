"""The provider retry policy: backoff bounds, retry-after parsing, classification, decisions."""

from __future__ import annotations

import email.utils
import random
from collections.abc import Mapping

import anthropic
import httpx2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.worker.provider_errors import StreamIncomplete, classify_exception
from tether.domain import DEFAULT_BACKOFF_INITIAL_S, DEFAULT_BACKOFF_MAX_S
from tether.retry import (
    SLEEP_LIMIT,
    ProviderCode,
    ProviderFailure,
    RetryPolicy,
    parse_retry_after,
    should_retry_status,
)

NOW = 1_800_000_000.0
"""A fixed clock for HTTP-date arithmetic."""

REQUEST = httpx2.Request("POST", "https://api.anthropic.com/v1/messages")


def fixed_now() -> float:
    return NOW


def http_date(offset: float) -> str:
    return email.utils.formatdate(NOW + offset, usegmt=True)


# Backoff ----------------------------------------------------------------------------------------


@given(
    retries_taken=st.integers(min_value=0, max_value=5000),
    draw=st.floats(min_value=0.0, max_value=1.0, exclude_max=True),
)
def test_backoff_stays_within_jitter_band(retries_taken: int, draw: float) -> None:
    nominal = min(
        DEFAULT_BACKOFF_INITIAL_S * 2.0 ** min(retries_taken, 1000), DEFAULT_BACKOFF_MAX_S
    )
    delay = RetryPolicy().backoff(retries_taken, rand=lambda: draw)
    # (0.75, 1.0] in exact arithmetic; a draw just below 1 rounds the factor to 0.75 exactly.
    assert 0.75 * nominal <= delay <= nominal


@given(
    retries_taken=st.integers(min_value=0, max_value=64),
    initial=st.floats(min_value=0.001, max_value=5.0),
    jitter=st.floats(min_value=0.0, max_value=1.0),
    draw=st.floats(min_value=0.0, max_value=1.0, exclude_max=True),
)
def test_backoff_bounds_hold_for_any_configuration(
    retries_taken: int, initial: float, jitter: float, draw: float
) -> None:
    policy = RetryPolicy(initial_delay=initial, max_delay=10.0, jitter=jitter)
    nominal = min(initial * 2.0**retries_taken, 10.0)
    delay = policy.backoff(retries_taken, rand=lambda: draw)
    assert nominal * (1 - jitter) <= delay <= nominal


def test_backoff_over_many_real_random_draws() -> None:
    policy = RetryPolicy()
    rng = random.Random(1234)
    for retries_taken, nominal in enumerate([0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]):
        delays = [policy.backoff(retries_taken, rand=rng.random) for _ in range(2000)]
        assert all(0.75 * nominal <= d <= nominal for d in delays)
        # The draws really spread over the band rather than sitting at one end.
        assert min(delays) < 0.8 * nominal
        assert max(delays) > 0.95 * nominal


def test_backoff_nominal_sequence_matches_the_sdk() -> None:
    policy = RetryPolicy()
    assert [policy.backoff(n, rand=lambda: 0.0) for n in range(7)] == [
        0.5,
        1.0,
        2.0,
        4.0,
        8.0,
        8.0,
        8.0,
    ]


def test_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError):
        RetryPolicy(initial_delay=9.0, max_delay=8.0)
    with pytest.raises(ValueError):
        RetryPolicy(jitter=1.5)


# Retry-after parsing ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        pytest.param(None, None, id="no-headers"),
        pytest.param({}, None, id="empty"),
        pytest.param({"retry-after-ms": "1500"}, 1.5, id="ms"),
        pytest.param({"retry-after-ms": "1500", "retry-after": "30"}, 1.5, id="ms-wins"),
        pytest.param({"retry-after-ms": "-5", "retry-after": "30"}, -0.005, id="negative-ms-wins"),
        pytest.param({"retry-after-ms": "soon", "retry-after": "2"}, 2.0, id="garbage-ms-skipped"),
        pytest.param({"retry-after-ms": "nan", "retry-after": "2"}, None, id="nan-ms-unusable"),
        pytest.param({"retry-after": "7"}, 7.0, id="integer-seconds"),
        pytest.param({"retry-after": "0.2"}, 0.2, id="float-seconds"),
        pytest.param({"retry-after": "0"}, 0.0, id="zero"),
        pytest.param({"retry-after": http_date(30)}, 30.0, id="future-date"),
        pytest.param({"retry-after": http_date(-120)}, -120.0, id="past-date"),
        pytest.param({"retry-after": "tomorrow-ish"}, None, id="garbage"),
        pytest.param({"Retry-After": "3"}, 3.0, id="plain-dict-any-case"),
        pytest.param(httpx2.Headers({"Retry-After-Ms": "250"}), 0.25, id="httpx2-headers"),
    ],
)
def test_parse_retry_after(headers: Mapping[str, str] | None, expected: float | None) -> None:
    assert parse_retry_after(headers, now=fixed_now) == expected


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        pytest.param({"retry-after-ms": "1500"}, 1.5, id="server-ms"),
        pytest.param({"retry-after": "120"}, 120.0, id="long-server-wait-not-shortened"),
        pytest.param({"retry-after": http_date(30)}, 30.0, id="server-date"),
        pytest.param({"retry-after": "1e12"}, SLEEP_LIMIT, id="absurd-wait-hits-sleep-limit"),
        pytest.param({"retry-after-ms": "-5", "retry-after": "30"}, 2.0, id="negative-ms-backoff"),
        pytest.param({"retry-after": http_date(-120)}, 2.0, id="past-date-backoff"),
        pytest.param({"retry-after": "0"}, 2.0, id="zero-backoff"),
        pytest.param({"retry-after": "garbage"}, 2.0, id="garbage-backoff"),
        pytest.param(None, 2.0, id="no-headers-backoff"),
    ],
)
def test_delay_prefers_a_positive_server_wait(
    headers: Mapping[str, str] | None, expected: float
) -> None:
    # retries_taken=2 gives a nominal backoff of 2 s; rand=0 removes the jitter.
    delay = RetryPolicy().delay(2, headers, now=fixed_now, rand=lambda: 0.0)
    assert delay == pytest.approx(expected)


def test_server_wait_is_not_jittered() -> None:
    assert RetryPolicy().delay(0, {"retry-after": "3"}, rand=lambda: 0.999) == 3.0


# Status rules -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "headers", "expected"),
    [
        (408, None, True),
        (409, None, True),
        (429, None, True),
        (500, None, True),
        (502, None, True),
        (503, None, True),
        (504, None, True),
        (529, None, True),
        (400, None, False),
        (401, None, False),
        (403, None, False),
        (404, None, False),
        (413, None, False),
        (422, None, False),
        (400, {"x-should-retry": "true"}, True),
        (500, {"x-should-retry": "false"}, False),
        (500, {"x-should-retry": "False"}, True),  # only the exact lowercase strings count
    ],
)
def test_should_retry_status(status: int, headers: dict[str, str] | None, expected: bool) -> None:
    assert should_retry_status(status, headers) is expected


# Classification ---------------------------------------------------------------------------------


def status_error(
    status: int, error_type: str, headers: dict[str, str] | None = None
) -> anthropic.APIStatusError:
    """A real SDK exception carrying a real error response, as the SDK raises it."""
    body = {
        "type": "error",
        "error": {"type": error_type, "message": "scripted"},
        "request_id": "req_1",
    }
    response = httpx2.Response(
        status, headers={"request-id": "req_1", **(headers or {})}, json=body, request=REQUEST
    )
    return anthropic.APIStatusError(f"Error code: {status} - {body}", response=response, body=body)


def mid_stream_error(error_type: str) -> anthropic.APIStatusError:
    event = {"type": "error", "error": {"type": error_type, "message": "scripted"}}
    response = httpx2.Response(200, headers={"request-id": "req_2"}, request=REQUEST)
    return anthropic.APIStatusError(str(event), response=response, body=event)


def chained(cause: BaseException) -> RuntimeError:
    try:
        raise RuntimeError("adapter wrapper") from cause
    except RuntimeError as exc:
        return exc


C = ProviderCode


@pytest.mark.parametrize(
    ("exc", "code", "retryable", "status"),
    [
        pytest.param(status_error(429, "rate_limit_error"), C.RATE_LIMITED, True, 429, id="429"),
        pytest.param(status_error(529, "overloaded_error"), C.OVERLOADED, True, 529, id="529"),
        pytest.param(status_error(500, "api_error"), C.SERVER_ERROR, True, 500, id="500"),
        pytest.param(status_error(502, "api_error"), C.SERVER_ERROR, True, 502, id="502"),
        pytest.param(status_error(503, "api_error"), C.SERVER_ERROR, True, 503, id="503"),
        pytest.param(status_error(504, "timeout_error"), C.TIMEOUT, True, 504, id="504"),
        pytest.param(status_error(408, "timeout_error"), C.TIMEOUT, True, 408, id="408"),
        pytest.param(status_error(409, "conflict_error"), C.CONFLICT, True, 409, id="409"),
        pytest.param(
            status_error(400, "invalid_request_error"), C.BAD_REQUEST, False, 400, id="400"
        ),
        pytest.param(status_error(401, "authentication_error"), C.AUTH, False, 401, id="401"),
        pytest.param(status_error(402, "billing_error"), C.BILLING, False, 402, id="402"),
        pytest.param(status_error(403, "permission_error"), C.AUTH, False, 403, id="403"),
        pytest.param(status_error(404, "not_found_error"), C.BAD_REQUEST, False, 404, id="404"),
        pytest.param(status_error(413, "request_too_large"), C.BAD_REQUEST, False, 413, id="413"),
        pytest.param(status_error(418, "invalid_request_error"), C.ERROR, False, 418, id="418"),
        pytest.param(
            status_error(400, "invalid_request_error", {"x-should-retry": "true"}),
            C.BAD_REQUEST,
            True,
            400,
            id="400-should-retry-true",
        ),
        pytest.param(
            status_error(500, "api_error", {"x-should-retry": "false"}),
            C.SERVER_ERROR,
            False,
            500,
            id="500-should-retry-false",
        ),
        pytest.param(mid_stream_error("overloaded_error"), C.OVERLOADED, True, 200, id="sse-529"),
        pytest.param(mid_stream_error("api_error"), C.SERVER_ERROR, True, 200, id="sse-api"),
        pytest.param(mid_stream_error("rate_limit_error"), C.RATE_LIMITED, True, 200, id="sse-429"),
        pytest.param(
            mid_stream_error("invalid_request_error"), C.BAD_REQUEST, False, 200, id="sse-400"
        ),
        pytest.param(anthropic.APITimeoutError(REQUEST), C.TIMEOUT, True, 0, id="sdk-timeout"),
        pytest.param(
            anthropic.APIConnectionError(request=REQUEST), C.CONNECTION, True, 0, id="sdk-conn"
        ),
        pytest.param(
            httpx2.RemoteProtocolError("incomplete chunked read"), C.STREAM_CUT, True, 200, id="cut"
        ),
        pytest.param(httpx2.ReadError("reset"), C.STREAM_CUT, True, 200, id="read-error"),
        pytest.param(httpx2.ReadTimeout("stalled"), C.TIMEOUT, True, 0, id="stall"),
        pytest.param(httpx2.ConnectError("refused"), C.CONNECTION, True, 0, id="connect"),
        pytest.param(StreamIncomplete(), C.STREAM_INCOMPLETE, True, 200, id="incomplete"),
        pytest.param(
            chained(httpx2.RemoteProtocolError("cut")), C.STREAM_CUT, True, 200, id="via-cause"
        ),
        pytest.param(ValueError("bad tool JSON"), C.ERROR, False, 0, id="unknown"),
    ],
)
def test_classify_exception(
    exc: BaseException, code: ProviderCode, retryable: bool, status: int
) -> None:
    failure = classify_exception(exc, now=fixed_now)
    assert (failure.code, failure.retryable, failure.status) == (code, retryable, status)
    assert failure.code.startswith("provider_")
    assert failure.message


def test_classification_reads_the_server_wait() -> None:
    exc = status_error(429, "rate_limit_error", {"retry-after": "2", "retry-after-ms": "1500"})
    failure = classify_exception(exc)
    assert failure.retry_after == 1.5
    assert failure.error_type == "rate_limit_error"
    assert failure.request_id == "req_1"
    assert failure.message == "scripted"


def test_classification_drops_a_non_positive_server_wait() -> None:
    exc = status_error(529, "overloaded_error", {"retry-after-ms": "-5", "retry-after": "30"})
    assert classify_exception(exc).retry_after is None


# Decisions --------------------------------------------------------------------------------------


def failure(retryable: bool = True, retry_after: float | None = None) -> ProviderFailure:
    code = C.OVERLOADED if retryable else C.BAD_REQUEST
    return ProviderFailure(code, "scripted", retryable, 529, retry_after)


def test_permanent_failure_is_not_retried() -> None:
    decision = RetryPolicy().decide(failure(retryable=False), 0)
    assert (decision.retry, decision.delay) == (False, 0.0)


def test_retryable_failure_backs_off_until_attempts_run_out() -> None:
    policy = RetryPolicy(max_attempts=3)
    first = policy.decide(failure(), 0, rand=lambda: 0.0)
    second = policy.decide(failure(), 1, rand=lambda: 0.0)
    last = policy.decide(failure(), 2, rand=lambda: 0.0)
    assert (first.retry, first.delay) == (True, 0.5)
    assert (second.retry, second.delay) == (True, 1.0)
    assert last.retry is False
    assert last.delay == 2.0  # still reported, for a durable reschedule


def test_server_wait_is_honoured_in_process_up_to_the_limit() -> None:
    decision = RetryPolicy().decide(failure(retry_after=5.0), 0, rand=lambda: 0.0)
    assert (decision.retry, decision.delay) == (True, 5.0)


def test_long_server_wait_is_handed_back_not_shortened() -> None:
    decision = RetryPolicy(max_server_delay=60.0).decide(failure(retry_after=120.0), 0)
    assert (decision.retry, decision.delay) == (False, 120.0)
    assert "120" in decision.reason


def test_single_attempt_policy_never_retries() -> None:
    assert RetryPolicy(max_attempts=1).decide(failure(), 0).retry is False
