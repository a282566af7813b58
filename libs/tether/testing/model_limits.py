"""The local model server's rate limiter: token buckets per API key, as the provider keeps them.

Off unless a server is given `RateLimits` (`ModelServer(limits=...)`, or
`--rate-limit requests=50,input_tokens=40000,output_tokens=8000,window=60` on the command line).
When on, every `/v1/messages` request with a key is admitted against three buckets of that key:

- requests: one per request;
- input tokens: the prompt's tokens (every input token, cached or not: stricter than the
  provider, which does not count cache reads against most models' limit);
- output tokens: `max_tokens` taken at admission and the unused part given back when the answer
  ends (the provider estimates output from `max_tokens` the same way).

Each bucket holds up to its limit and refills continuously at limit/window per second, so a
window of a few seconds lets a test meet the limiter without waiting minutes. Every answer
carries `anthropic-ratelimit-{requests,input-tokens,output-tokens}-{limit,remaining,reset}`
(reset: RFC 3339, when the bucket is full again) and the `anthropic-ratelimit-tokens-*` triple
(the input and output buckets together); a request a bucket cannot hold is answered 429
`rate_limit_error` with `retry-after` (whole seconds, rounded up) and takes nothing.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from aiohttp import web

from tether.testing.model_cache import input_tokens_for
from tether.testing.model_log import RecordedRequest, error_response

KINDS = ("requests", "input_tokens", "output_tokens")


class RateLimitFormatError(ValueError):
    """A `--rate-limit` value that does not parse; the message names the part at fault."""


@dataclass(frozen=True)
class RateLimits:
    """Limits per key and window (seconds). None leaves that bucket unlimited."""

    requests: int | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    window: float = 60.0

    def __post_init__(self) -> None:
        if not (self.window > 0 and math.isfinite(self.window)):
            raise RateLimitFormatError(f"window must be a positive number, not {self.window}")
        for kind in KINDS:
            value = getattr(self, kind)
            if value is not None and value <= 0:
                raise RateLimitFormatError(f"{kind} must be a positive integer, not {value}")

    @classmethod
    def parse(cls, text: str) -> RateLimits:
        """`requests=50,input_tokens=40000,output_tokens=8000,window=60` (any subset)."""
        values: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, raw = part.partition("=")
            name = name.strip().replace("-", "_")
            if not sep or name not in (*KINDS, "window"):
                raise RateLimitFormatError(
                    f"{part!r}: expected NAME=VALUE with NAME one of "
                    "requests, input_tokens, output_tokens, window"
                )
            try:
                values[name] = float(raw) if name == "window" else int(raw)
            except ValueError:
                raise RateLimitFormatError(f"{part!r}: {raw.strip()!r} is not a number") from None
        return cls(**values)


@dataclass
class Bucket:
    """A token bucket: holds up to `capacity`, refills at capacity/window per second."""

    capacity: float
    window: float
    level: float
    updated: float

    @property
    def rate(self) -> float:
        return self.capacity / self.window

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = max(self.updated, now)

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` fits (0 when it does now)."""
        return max(0.0, (min(amount, self.capacity) - self.level) / self.rate)

    def until_full(self) -> float:
        return max(0.0, (self.capacity - self.level) / self.rate)


@dataclass
class _Admitted:
    key: str
    output_taken: int


_ADMITTED = web.RequestKey("tether.model_limits.admitted", _Admitted)
_HEADERS = web.RequestKey("tether.model_limits.headers", dict[str, str])


@dataclass
class KeyBuckets:
    """One API key's buckets (None where that kind is unlimited)."""

    buckets: dict[str, Bucket | None] = field(default_factory=dict)


class ModelRateLimiter:
    """The buckets of every key, on the server's event loop."""

    def __init__(
        self,
        limits: RateLimits,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.limits = limits
        self._clock = clock
        self._wall = wall
        self._keys: dict[str, KeyBuckets] = {}
        self.refused = 0

    def clear(self) -> None:
        """Every key's buckets full again."""
        self._keys.clear()
        self.refused = 0

    def _of(self, key: str) -> KeyBuckets:
        held = self._keys.get(key)
        if held is None:
            now = self._clock()
            held = KeyBuckets(
                {
                    kind: None
                    if (limit := getattr(self.limits, kind)) is None
                    else Bucket(float(limit), self.limits.window, float(limit), now)
                    for kind in KINDS
                }
            )
            self._keys[key] = held
        now = self._clock()
        for bucket in held.buckets.values():
            if bucket is not None:
                bucket.refill(now)
        return held

    def try_take(self, key: str, input_tokens: int, max_tokens: int) -> float | None:
        """Take one request, the input and `max_tokens` from `key`'s buckets; None when taken,
        else the seconds until all three fit (nothing is taken then)."""
        held = self._of(key)
        wanted = {"requests": 1, "input_tokens": input_tokens, "output_tokens": max_tokens}
        wait = 0.0
        for kind, bucket in held.buckets.items():
            if bucket is not None:
                wait = max(wait, bucket.wait_for(wanted[kind]))
        if wait > 0:
            return wait
        for kind, bucket in held.buckets.items():
            if bucket is not None:
                bucket.level -= min(wanted[kind], bucket.capacity)
        return None

    def give_back_output(self, key: str, unused: int) -> None:
        """Return output tokens taken at admission but not produced."""
        bucket = self._of(key).buckets["output_tokens"]
        if bucket is not None and unused > 0:
            bucket.level = min(bucket.capacity, bucket.level + unused)

    def remaining(self, key: str) -> dict[str, float | None]:
        """What each of `key`'s buckets holds now (None: unlimited)."""
        held = self._of(key)
        return {k: None if b is None else b.level for k, b in held.buckets.items()}

    def headers(self, key: str) -> dict[str, str]:
        """The `anthropic-ratelimit-*` headers for `key`'s buckets as they stand."""
        held = self._of(key)
        out: dict[str, str] = {}
        tokens: list[Bucket] = []
        for kind, bucket in held.buckets.items():
            if bucket is None:
                continue
            name = kind.replace("_", "-")
            out.update(self._triple(name, bucket.capacity, bucket.level, bucket.until_full()))
            if kind != "requests":
                tokens.append(bucket)
        if tokens:
            out.update(
                self._triple(
                    "tokens",
                    sum(b.capacity for b in tokens),
                    sum(b.level for b in tokens),
                    max(b.until_full() for b in tokens),
                )
            )
        return out

    def _triple(self, name: str, limit: float, level: float, full_in: float) -> dict[str, str]:
        reset = datetime.fromtimestamp(self._wall(), UTC) + timedelta(seconds=full_in)
        prefix = f"anthropic-ratelimit-{name}"
        return {
            f"{prefix}-limit": str(int(limit)),
            f"{prefix}-remaining": str(max(0, math.floor(level))),
            f"{prefix}-reset": reset.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        }

    # The server's hooks ------------------------------------------------------------------------

    def admit(
        self, request: web.Request, record: RecordedRequest, body: dict[str, Any]
    ) -> web.Response | None:
        """Admit a valid request, or answer it 429; either way its answer gets the headers."""
        key = api_key_id(request)
        declared = body.get("max_tokens")
        max_tokens = declared if isinstance(declared, int) and declared > 0 else 0
        wait = self.try_take(key, input_tokens_for(body), max_tokens)
        headers = self.headers(key)
        request[_HEADERS] = headers
        if wait is None:
            request[_ADMITTED] = _Admitted(key, max_tokens)
            return None
        self.refused += 1
        record.served = "rate_limited"
        return error_response(
            429,
            "rate_limit_error",
            "This request would exceed the rate limit for your organization of "
            f"{_limits_text(self.limits)}. Please retry after {math.ceil(wait)} seconds.",
            record.request_id,
            record,
            {"retry-after": str(max(1, math.ceil(wait)))},
        )

    def settle(self, request: web.Request, record: RecordedRequest) -> None:
        """The answer ended: give back the output tokens it did not produce."""
        admitted = request.get(_ADMITTED)
        if admitted is None:
            return
        del request[_ADMITTED]
        produced = 0 if record.usage is None else int(record.usage.get("output_tokens", 0))
        self.give_back_output(admitted.key, admitted.output_taken - produced)

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """aiohttp's `on_response_prepare`: the headers go on every answer, streamed or not."""
        headers = request.get(_HEADERS)
        if headers is not None:
            response.headers.update(headers)


def api_key_id(request: web.Request) -> str:
    """The bucket's key: a digest of the credential (the credential itself is never kept)."""
    secret = request.headers.get("x-api-key") or request.headers.get("authorization") or ""
    return hashlib.sha256(secret.encode()).hexdigest()[:16]


def _limits_text(limits: RateLimits) -> str:
    parts = [
        f"{getattr(limits, kind)} {kind.replace('_', ' ')}"
        for kind in KINDS
        if getattr(limits, kind) is not None
    ]
    return f"{', '.join(parts)} per {limits.window:g} seconds"
