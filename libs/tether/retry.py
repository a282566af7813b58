"""The provider retry policy: which model-call failures to retry, and how long to wait first.

Pure logic, no I/O and no SDK: the worker's provider adapter catches an exception, asks
`services.worker.provider_errors.classify_exception` what it was, and asks `RetryPolicy.decide`
whether and when to try again. The orchestrator and the client use the policy alone, so neither
imports the provider SDK.

The numbers and rules mirror the Anthropic SDK's own retry loop (`_base_client.py`: initial
0.5 s, cap 8 s, jitter factor in (0.75, 1.0], `retry-after-ms` before `retry-after`,
`x-should-retry` overriding the status) so that a run retried by Tether behaves like one
retried by the SDK. Tether retries itself, with the SDK's `max_retries=0`, because the SDK
never retries a stream that already started, and a durable runtime must.

Where Tether differs, on purpose:

* Failures the SDK does not retry are retryable here: a mid-stream `error` event of type
  `overloaded_error` / `api_error` / `rate_limit_error`, a cut stream (`httpx2.RemoteProtocolError`,
  `httpx2.ReadError`), a stalled stream (`httpx2.ReadTimeout`), and a stream that ended cleanly
  before `message_stop` (the SDK raises nothing; the adapter raises `StreamIncomplete`).
* A server-requested wait is honoured in full, never shortened and never jittered. But a
  worker should not hold a lease while sleeping for minutes, so when the server asks for more
  than `max_server_delay` (60 s by default, the limit older SDKs used), `decide` says *don't
  retry in process* and still reports the wait, so the caller can park the run durably until
  then instead of retrying early.
"""

from __future__ import annotations

import email.utils
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from tether.domain import DEFAULT_BACKOFF_INITIAL_S, DEFAULT_BACKOFF_MAX_S

JITTER = 0.25
"""Backoff is multiplied by `1 - JITTER * random()`, a factor in (0.75, 1.0], as in the SDK."""

MAX_SERVER_DELAY = 60.0
"""Longest server-requested wait spent asleep in process; longer ones are parked durably."""

SLEEP_LIMIT = 4_294_967.0
"""The SDK's ceiling on any wait (2**32 ms, a platform sleep limit); about 50 days."""

MAX_EXPONENT = 1000
"""Bounds `2 ** n` so a huge retry count cannot overflow a float."""

RETRYABLE_STATUSES = frozenset({408, 409, 429})
"""Retryable below 500: request timeout, lock conflict, rate limit. Every status >= 500 is too."""


class ProviderCode(StrEnum):
    """Stable codes for provider failures; they appear in run events and metrics."""

    RATE_LIMITED = "provider_rate_limited"
    OVERLOADED = "provider_overloaded"
    SERVER_ERROR = "provider_server_error"
    TIMEOUT = "provider_timeout"
    CONNECTION = "provider_connection"
    STREAM_CUT = "provider_stream_cut"
    STREAM_INCOMPLETE = "provider_stream_incomplete"
    BAD_REQUEST = "provider_bad_request"
    AUTH = "provider_auth"
    BILLING = "provider_billing"
    CONFLICT = "provider_conflict"
    ERROR = "provider_error"


@dataclass(frozen=True)
class ProviderFailure:
    """What went wrong with a model call, in Tether's terms.

    `status` is the HTTP status: 200 for a failure inside a started stream (an error event, a
    cut or an incomplete body), 0 when no status applies (connection failures, timeouts).
    `retry_after` is the server's requested wait in seconds, present only when positive.
    `error_type` is the API's `error.type`, if any.
    """

    code: ProviderCode
    message: str
    retryable: bool
    status: int
    retry_after: float | None = None
    error_type: str | None = None
    request_id: str | None = None


@dataclass(frozen=True)
class RetryDecision:
    """Whether to try again in process, and the wait before the next attempt may start.

    When `retry` is False for a retryable failure (attempts spent, or the server asked for
    longer than `max_server_delay`), `delay` still says how long a durable reschedule should
    wait; for a permanent failure it is 0.
    """

    retry: bool
    delay: float
    reason: str


@dataclass(frozen=True)
class RetryPolicy:
    """Retry limits and timing. `max_attempts` counts the first attempt (3 = SDK default)."""

    max_attempts: int = 3
    initial_delay: float = DEFAULT_BACKOFF_INITIAL_S
    max_delay: float = DEFAULT_BACKOFF_MAX_S
    jitter: float = JITTER
    max_server_delay: float = MAX_SERVER_DELAY

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if not 0 <= self.initial_delay <= self.max_delay:
            raise ValueError("need 0 <= initial_delay <= max_delay")
        if not 0 <= self.jitter <= 1:
            raise ValueError("jitter must lie in [0, 1]")
        if self.max_server_delay < 0:
            raise ValueError("max_server_delay must not be negative")

    def backoff(self, retries_taken: int, *, rand: Callable[[], float] = random.random) -> float:
        """Jittered exponential backoff before retry number `retries_taken + 1`.

        `min(initial * 2**n, max) * (1 - jitter * rand())`; with `rand()` in [0, 1) the
        factor lies in (1 - jitter, 1] (float rounding can land exactly on 1 - jitter).
        """
        exponent = min(max(retries_taken, 0), MAX_EXPONENT)
        nominal = min(self.initial_delay * 2.0**exponent, self.max_delay)
        return max(nominal * (1 - self.jitter * rand()), 0.0)

    def delay(
        self,
        retries_taken: int,
        headers: Mapping[str, str] | None,
        *,
        now: Callable[[], float] = time.time,
        rand: Callable[[], float] = random.random,
    ) -> float:
        """The wait before the next attempt: the server's positive request, else backoff.

        Like the SDK, a server value is used as is (no jitter, no `max_delay` cap, only the
        ~50-day `SLEEP_LIMIT`); `max_server_delay` is applied by `decide`, not here.
        """
        return self._wait(retries_taken, parse_retry_after(headers, now=now), rand)

    def decide(
        self,
        failure: ProviderFailure,
        retries_taken: int,
        *,
        rand: Callable[[], float] = random.random,
    ) -> RetryDecision:
        """Whether to retry after `failure`, given `retries_taken` retries already made."""
        if not failure.retryable:
            return RetryDecision(False, 0.0, f"{failure.code} is not retryable")
        wait = self._wait(retries_taken, failure.retry_after, rand)
        if retries_taken + 1 >= self.max_attempts:
            return RetryDecision(False, wait, f"{self.max_attempts} attempts made")
        if failure.retry_after is not None and wait > self.max_server_delay:
            return RetryDecision(
                False,
                wait,
                f"server asked to wait {wait:g}s, over the {self.max_server_delay:g}s "
                "in-process limit",
            )
        return RetryDecision(True, wait, f"retry {retries_taken + 1} of {self.max_attempts - 1}")

    def _wait(self, retries_taken: int, server: float | None, rand: Callable[[], float]) -> float:
        if server is not None and server > 0:
            return min(server, SLEEP_LIMIT)
        return self.backoff(retries_taken, rand=rand)


def parse_retry_after(
    headers: Mapping[str, str] | None, *, now: Callable[[], float] = time.time
) -> float | None:
    """The server's requested wait in seconds, as the SDK reads it; None when absent or garbage.

    `retry-after-ms` wins whenever it parses as a number, even a negative one (which then
    means "use backoff", and `retry-after` is not consulted). Otherwise `retry-after` is read
    as float seconds, then as an HTTP date relative to `now()` (negative when in the past).
    Callers treat anything not > 0 as "no server delay". NaN counts as unusable.
    """
    if headers is None:
        return None
    millis = _float(_header(headers, "retry-after-ms"))
    if millis is not None:
        return None if math.isnan(millis) else millis / 1000
    value = _header(headers, "retry-after")
    if value is None:
        return None
    seconds = _float(value)
    if seconds is not None:
        return None if math.isnan(seconds) else seconds
    parsed = email.utils.parsedate_tz(value)
    if parsed is None:
        return None
    return float(email.utils.mktime_tz(parsed) - now())


def should_retry_status(status: int, headers: Mapping[str, str] | None = None) -> bool:
    """The SDK's rule: `x-should-retry: true|false` wins, else 408, 409, 429 and >= 500."""
    override = _header(headers, "x-should-retry") if headers is not None else None
    if override == "true":
        return True
    if override == "false":
        return False
    return status in RETRYABLE_STATUSES or status >= 500


def _header(headers: Mapping[str, str], name: str) -> str | None:
    """Case-insensitive lookup that also works for a plain dict."""
    value = headers.get(name)
    if value is not None:
        return value
    for key, candidate in headers.items():
        if key.lower() == name:
            return candidate
    return None


def _float(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return None
