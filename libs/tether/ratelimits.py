"""Model rate limits: the buckets a pool of workers shares for one provider credential and model.

Three token buckets per (credential, model): requests, input tokens and output tokens, each
holding up to its limit and refilling continuously at limit/window per second (the provider's
own algorithm). A model call reserves one request, its estimated input tokens and its
`max_tokens` before it starts, and is reconciled with the usage it reports when it ends (the
difference given back, or taken). The operator configures limits (`TETHER_MODEL_LIMITS`, format
in `parse_model_limits`); the provider's `anthropic-ratelimit-*` headers teach the rest: a
bucket adopts the provider's limit where the operator set none (or a lower one than the
operator's), and never holds more than the provider said remains. A 429 empties the bucket
until its `retry-after` has passed.

Pure arithmetic on a caller's clock: the orchestrator keeps these in memory (see
services/orchestrator/rate_limits.py).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from tether.errors import InvalidArgument

RATE_LIMITED = "rate_limited"
"""The error code of a run waiting retry-pending for a shared model rate limit to refill: its
wait spends none of its attempts."""
KINDS = ("requests", "input_tokens", "output_tokens")
_HEADER_NAMES = {
    "requests": "requests",
    "input_tokens": "input-tokens",
    "output_tokens": "output-tokens",
}
DEFAULT_WINDOW_S = 60.0
MIN_WINDOW_S, MAX_WINDOW_S = 0.1, 3600.0  # what a window learned from -reset is kept within


@dataclass(frozen=True)
class Limit:
    """One (credential, model)'s configured limits per window; None: not configured."""

    requests: int | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    window_s: float = DEFAULT_WINDOW_S


def credential_id(secret: str) -> str:
    """A provider credential's id for its buckets: a digest, never the credential."""
    return "cred-" + hashlib.sha256(secret.encode()).hexdigest()[:16]


def parse_model_limits(text: str) -> dict[tuple[str, str], Limit]:
    """`TETHER_MODEL_LIMITS`: entries separated by `;`, each `[CREDENTIAL/]MODEL: NAME=N, ...`
    with NAME one of requests, input_tokens, output_tokens (per window) and window (seconds,
    default 60). MODEL `*` is every model; CREDENTIAL (a credential id, see `credential_id`) is
    every credential when absent. For example
    `claude-sonnet-5-5: requests=50, input_tokens=30000, output_tokens=8000`."""
    limits: dict[tuple[str, str], Limit] = {}
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        target, sep, body = entry.partition(":")
        if not sep or not target.strip():
            raise InvalidArgument(
                f"TETHER_MODEL_LIMITS entry {entry!r}: expected [CREDENTIAL/]MODEL: NAME=N, ..."
            )
        credential, _, model = target.strip().rpartition("/")
        values: dict[str, int | float] = {}
        for part in filter(None, (p.strip() for p in body.split(","))):
            name, eq, raw = part.partition("=")
            name = name.strip().replace("-", "_")
            if not eq or name not in (*KINDS, "window"):
                raise InvalidArgument(
                    f"TETHER_MODEL_LIMITS entry {entry!r}: {part!r} is not NAME=N with NAME one "
                    "of requests, input_tokens, output_tokens, window"
                )
            try:
                number = float(raw)
            except ValueError:
                number = math.nan
            if not (number > 0 and math.isfinite(number)):
                raise InvalidArgument(
                    f"TETHER_MODEL_LIMITS entry {entry!r}: {name} must be a positive number"
                )
            values["window_s" if name == "window" else name] = (
                number if name == "window" else int(number)
            )
        limits[(credential or "*", model.strip())] = Limit(**values)  # type: ignore[arg-type]
    return limits


def limit_for(limits: Mapping[tuple[str, str], Limit], credential: str, model: str) -> Limit:
    """The most specific configured limit for (credential, model), or an empty one."""
    for key in ((credential, model), ("*", model), (credential, "*"), ("*", "*")):
        if key in limits:
            return limits[key]
    return Limit()


@dataclass
class Bucket:
    """A token bucket; `level` may go below zero (a debt: a turn used more than it reserved,
    or a 429 said to wait), and refills from there."""

    capacity: float
    window_s: float
    level: float
    updated: float
    configured: float | None = None  # the operator's limit, which a learned one never exceeds
    # The operator's window: a learned one never refills the bucket faster than it.
    configured_window_s: float | None = None

    @property
    def rate(self) -> float:
        return self.capacity / self.window_s

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` (at most the capacity) fits; 0 when it does now."""
        return max(0.0, (min(amount, self.capacity) - self.level) / self.rate)

    def take(self, amount: float) -> None:
        self.level -= min(amount, self.capacity)

    def give(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)

    def learn(
        self,
        limit: float | None,
        remaining: float | None,
        now: float,
        full_in_s: float | None = None,
    ) -> None:
        """What the provider said: its limit (never above the operator's), what remains, and
        when the bucket is full again (which gives its refill rate, so its window)."""
        self.refill(now)
        if limit is not None and limit > 0:
            self.capacity = limit if self.configured is None else min(limit, self.configured)
        if full_in_s and remaining is not None and 0 <= remaining < self.capacity:
            window = full_in_s * self.capacity / (self.capacity - remaining)
            if self.configured_window_s is not None:
                window = max(window, self.configured_window_s)
            self.window_s = min(max(window, MIN_WINDOW_S), MAX_WINDOW_S)
        if remaining is not None:
            self.level = min(self.level, remaining)
        self.level = min(self.level, self.capacity)

    def empty_for(self, seconds: float, now: float) -> None:
        """A 429: nothing fits until `seconds` have passed."""
        self.refill(now)
        self.level = min(self.level, -seconds * self.rate)


@dataclass(frozen=True)
class Headers:
    """What a provider answer's `anthropic-ratelimit-*` and `retry-after` headers said."""

    limits: dict[str, float] = field(default_factory=dict)
    remaining: dict[str, float] = field(default_factory=dict)
    retry_after_s: float | None = None
    full_in_s: dict[str, float] = field(default_factory=dict)  # from the -reset times

    @classmethod
    def read(cls, headers: Mapping[str, str], now: datetime | None = None) -> Headers:
        """Parse the headers (names in any case); absent or malformed values are skipped.
        `now` (default: the wall clock) turns the -reset times into seconds from now."""
        lower = {k.lower(): v for k, v in headers.items()}
        limits: dict[str, float] = {}
        remaining: dict[str, float] = {}
        full_in: dict[str, float] = {}
        wall = now or datetime.now(UTC)
        for kind, name in _HEADER_NAMES.items():
            for target, part in ((limits, "limit"), (remaining, "remaining")):
                value = _number(lower.get(f"anthropic-ratelimit-{name}-{part}"))
                if value is not None:
                    target[kind] = value
            reset = parse_reset(lower.get(f"anthropic-ratelimit-{name}-reset"))
            if reset is not None:
                full_in[kind] = max(0.0, (reset - wall).total_seconds())
        retry = _number(lower.get("retry-after"))
        if retry is None and (ms := _number(lower.get("retry-after-ms"))) is not None:
            retry = ms / 1000
        return cls(limits, remaining, retry, full_in)

    def __bool__(self) -> bool:
        return bool(self.limits or self.remaining or self.retry_after_s is not None)


def _number(raw: str | None) -> float | None:
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


def parse_reset(raw: str | None) -> datetime | None:
    """An `-reset` header's RFC 3339 time, or None."""
    if not raw:
        return None
    try:
        parsed = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


class ModelBuckets:
    """One (credential, model)'s three buckets; a kind without a limit (configured or
    learned) is unlimited until the provider names one."""

    def __init__(self, limit: Limit, now: float) -> None:
        self.window_s = limit.window_s
        self.buckets: dict[str, Bucket | None] = {}
        for kind in KINDS:
            configured = getattr(limit, kind)
            self.buckets[kind] = (
                None
                if configured is None
                else Bucket(configured, limit.window_s, configured, now, configured, limit.window_s)
            )

    def refill(self, now: float) -> None:
        for bucket in self.buckets.values():
            if bucket is not None:
                bucket.refill(now)

    def wait_for(self, wanted: Mapping[str, float], now: float) -> float:
        """Seconds until every kind of `wanted` fits (0: now)."""
        self.refill(now)
        waits = [b.wait_for(wanted[k]) for k, b in self.buckets.items() if b is not None]
        return max(waits, default=0.0)

    def wait_behind(
        self, ahead: Sequence[Mapping[str, float]], wanted: Mapping[str, float], now: float
    ) -> float:
        """Seconds until the buckets, having served every call `ahead` first, hold `wanted`
        too (0: now)."""
        self.refill(now)
        waits = [
            (sum(a[k] for a in ahead) + min(wanted[k], b.capacity) - b.level) / b.rate
            for k, b in self.buckets.items()
            if b is not None
        ]
        return max(0.0, *waits)

    def try_reserve(self, wanted: Mapping[str, float], now: float) -> float:
        """Take `wanted` when it all fits and return 0; else take nothing and return the
        seconds until it fits."""
        wait = self.wait_for(wanted, now)
        if wait > 0:
            return wait
        for kind, bucket in self.buckets.items():
            if bucket is not None:
                bucket.take(wanted[kind])
        return 0.0

    def reconcile(self, reserved: Mapping[str, float], used: Mapping[str, float]) -> None:
        """A call ended: give back what it reserved and did not use (or take what it used past
        its reservation)."""
        for kind, bucket in self.buckets.items():
            if bucket is not None and kind in used:
                bucket.give(min(reserved[kind], bucket.capacity) - used[kind])

    def release(self, reserved: Mapping[str, float]) -> None:
        """A call that never reported (its worker died): give back all but its request."""
        for kind, bucket in self.buckets.items():
            if bucket is not None and kind != "requests":
                bucket.give(min(reserved[kind], bucket.capacity))

    def learn(self, headers: Headers, now: float) -> None:
        """Adopt what the provider's headers said; a 429's retry-after empties the buckets it
        named as exhausted (all of them when it named none) until then."""
        for kind in KINDS:
            limit, remaining = headers.limits.get(kind), headers.remaining.get(kind)
            if limit is None and remaining is None:
                continue
            bucket = self.buckets[kind]
            if bucket is None:
                if limit is None:
                    continue
                bucket = Bucket(limit, self.window_s, limit, now)
                self.buckets[kind] = bucket
            bucket.learn(limit, remaining, now, headers.full_in_s.get(kind))
        if headers.retry_after_s is not None:
            exhausted = [k for k in KINDS if headers.remaining.get(k) == 0] or list(KINDS)
            for kind in exhausted:
                bucket = self.buckets[kind]
                if bucket is not None:
                    bucket.empty_for(headers.retry_after_s, now)

    def levels(self) -> dict[str, float | None]:
        return {k: None if b is None else b.level for k, b in self.buckets.items()}
