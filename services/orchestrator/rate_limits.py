"""Model rate limits, granted from memory: the buckets of every (credential, model) this
replica's workers call, and the reservations their calls hold.

A worker reserves a call's room before it starts (ReserveModelRequest on its Work stream: one
request, the estimated input tokens, `max_tokens`) and settles it when the call ends
(SettleModelRequest: the usage it reported and the provider's `anthropic-ratelimit-*` headers,
which teach the buckets; a 429's `retry-after` empties them until then). A grant is arithmetic
on this replica's memory: no PostgreSQL statement, no Redis round trip. A reservation is let go
with its lease: when the run's outcome is written, when its worker's stream ends (a worker
killed mid-call: its stream breaks at once, or its lease lapses within one lease TTL and the
keepalive that no longer names it lets it go), and the tokens it held come back.

Several replicas: each grants from its share of every limit, its connected workers over every
live replica's (or the operator's `TETHER_ORCHESTRATOR_MODEL_LIMIT_SHARE`), and the provider's
headers, which every replica's workers see, pull every replica's buckets down to what the
provider says remains pool-wide. The levels and the shares' inputs are written to PostgreSQL
in batches, off the grant's path (limit_store.py). See the README's "Model rate limits".
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tether.errors import InvalidArgument
from tether.ratelimits import Headers, Limit, ModelBuckets, limit_for, parse_model_limits

log = logging.getLogger(__name__)


@dataclass
class Waiter:
    """A run whose call a bucket refused, in the order the calls were refused: it keeps its
    place until it is granted or `until` passes (it did not come back: cancelled, or leased
    by another replica)."""

    wanted: dict[str, float]
    until: float


@dataclass(frozen=True)
class Reservation:
    """One call's room, held until it is settled or its lease is let go."""

    key: tuple[str, str]
    run_id: str
    epoch: int
    wanted: dict[str, float]


class ModelLimits:
    """The buckets and reservations of this replica."""

    def __init__(
        self,
        limits: Mapping[tuple[str, str], Limit] | None = None,
        *,
        share: float = 1.0,
        recheck_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < share <= 1:
            raise InvalidArgument(f"the model limit share must be in (0, 1], not {share}")
        self._limits = dict(limits or {})
        self._share = share
        # A refusal while calls are in flight waits at most this long: they give back what
        # they reserved and did not use (most of max_tokens, as a rule) when they settle.
        self._recheck_s = recheck_s
        self._in_flight: dict[tuple[str, str], int] = {}
        self._clock = clock
        self._buckets: dict[tuple[str, str], ModelBuckets] = {}
        self._reservations: dict[int, Reservation] = {}
        self._by_run: dict[str, set[int]] = {}
        self._ids = itertools.count(1)
        self.refused = 0
        # Until when (this clock) the latest refusal said its bucket cannot hold a call: see
        # `leases_held_for`.
        self._refused_until = 0.0
        # The runs refused by each (credential, model)'s buckets and not yet granted, first
        # refused first: a call is granted only once the buckets hold the calls of those ahead
        # of it too, so the grants follow the order the runs were leased in.
        self._waiting: dict[tuple[str, str], dict[str, Waiter]] = {}
        # Set by every grant, settlement and let-go: the levels changed since the store last
        # wrote them (services/orchestrator/limit_store.py).
        self.dirty = False
        # False until the first round with the shared state (limit_store.LimitStore) resumed the
        # buckets and computed this replica's share: a replica that just started grants nothing
        # before, so it cannot burst from full buckets. Built without a store: ready.
        self.ready = True

    @classmethod
    def from_text(cls, text: str, share: float = 1.0, recheck_s: float = 1.0) -> ModelLimits:
        """From `TETHER_MODEL_LIMITS` (see tether.ratelimits.parse_model_limits)."""
        return cls(parse_model_limits(text), share=share, recheck_s=recheck_s)

    def buckets(self, credential: str, model: str) -> ModelBuckets:
        key = (credential, model)
        held = self._buckets.get(key)
        if held is None:
            limit = limit_for(self._limits, credential, model)
            if self._share < 1:
                limit = _scaled(limit, self._share)
            held = self._buckets[key] = ModelBuckets(limit, self._clock())
        return held

    # -- shared state (written and read in batches, off the grant's path) ----------------------

    @property
    def share(self) -> float:
        return self._share

    def set_share(self, share: float) -> None:
        """This replica's share of every limit changed (replicas or their workers came or
        went): every bucket's capacity, level and refill rate scale with it."""
        if not 0 < share <= 1:
            raise InvalidArgument(f"the model limit share must be in (0, 1], not {share}")
        factor = share / self._share
        if factor == 1:
            return
        now = self._clock()
        for held in self._buckets.values():
            for bucket in held.buckets.values():
                if bucket is not None:
                    bucket.refill(now)
                    bucket.capacity *= factor
                    bucket.level *= factor
                    if bucket.configured is not None:
                        bucket.configured *= factor
        self._share = share

    def levels(self) -> list[tuple[str, str, dict[str, float | None]]]:
        """Every (credential, model)'s levels now, as the pool's: this replica's over its
        share (None: a kind without a limit)."""
        now = self._clock()
        out = []
        for (credential, model), held in self._buckets.items():
            held.refill(now)
            pool = {k: None if v is None else v / self._share for k, v in held.levels().items()}
            out.append((credential, model, pool))
        return out

    def resume(
        self, credential: str, model: str, pool: Mapping[str, float | None], elapsed_s: float
    ) -> None:
        """A replica starting: the buckets of (credential, model) hold this replica's share of
        the pool's levels measured `elapsed_s` ago, refilled since, instead of starting full."""
        held = self.buckets(credential, model)
        now = self._clock()
        for kind, bucket in held.buckets.items():
            level = pool.get(kind)
            if bucket is not None and level is not None:
                refilled = level * self._share + max(0.0, elapsed_s) * bucket.rate
                bucket.level = min(bucket.capacity, refilled)
                bucket.updated = now

    # -- reservations ---------------------------------------------------------------------------

    def reserve(
        self,
        run_id: str,
        epoch: int,
        credential: str,
        model: str,
        input_tokens: int,
        output_tokens: int,
    ) -> tuple[int, float]:
        """(reservation id, 0) when the call fits now; (0, seconds until it does) when not."""
        if input_tokens < 0 or output_tokens < 0:
            raise InvalidArgument("a reservation's token counts must not be negative")
        wanted = {"requests": 1.0, "input_tokens": input_tokens, "output_tokens": output_tokens}
        if not self.ready:
            self.refused += 1
            return 0, self._recheck_s
        key = (credential, model)
        now = self._clock()
        ahead = self._ahead_of(key, run_id, now)
        buckets = self.buckets(credential, model)
        wait = buckets.wait_behind(ahead, wanted, now) if ahead else 0.0
        if wait <= 0:
            wait = buckets.try_reserve(wanted, now)
        if wait > 0:
            self.refused += 1
            if self._in_flight.get(key):
                wait = min(wait, self._recheck_s)
            waiting = self._waiting.setdefault(key, {})
            until = now + wait + 2 * self._recheck_s
            if run_id in waiting:
                waiting[run_id].until = until
            else:
                waiting[run_id] = Waiter(wanted, until)
            if not ahead:
                # The first in line: no run is leased before its call fits. Those behind it
                # (`_ahead_of` keeps them there) stretch nothing.
                self._refused_until = max(self._refused_until, now + wait)
            return 0, wait
        self._waiting.get(key, {}).pop(run_id, None)
        self._in_flight[key] = self._in_flight.get(key, 0) + 1
        self.dirty = True
        reservation_id = next(self._ids)
        self._reservations[reservation_id] = Reservation(key, run_id, epoch, wanted)
        self._by_run.setdefault(run_id, set()).add(reservation_id)
        return reservation_id, 0.0

    def _ahead_of(self, key: tuple[str, str], run_id: str, now: float) -> list[dict[str, float]]:
        """What the runs refused before `run_id` by `key`'s buckets, still waiting, want (the
        runs that did not come back in time dropped)."""
        waiting = self._waiting.get(key)
        if not waiting:
            return []
        for gone in [r for r, w in waiting.items() if w.until < now]:
            del waiting[gone]
        ahead = []
        for waiter_id, waiter in waiting.items():
            if waiter_id == run_id:
                break
            ahead.append(waiter.wanted)
        return ahead

    def leases_held_for(self) -> float:
        """Seconds this replica should lease no run yet (0: lease): a call was refused until
        then. A run leased meanwhile would take the room the refused runs wait for when it comes
        back (they are parked retry-pending, outside the fair queue) or be refused and parked
        in its turn, and the grants would go to whichever call asked first after a refill, not
        in the fair order: a run can then be refused again and again while runs leased after it
        complete. Held, the refused runs are leased again first (their start tags are the
        least queued) and the pool takes no more runs than the limit serves."""
        return max(0.0, self._refused_until - self._clock())

    def settle(
        self,
        reservation_id: int,
        credential: str,
        model: str,
        used: Mapping[str, float] | None,
        headers: Headers,
    ) -> None:
        """A call ended: reconcile its reservation with `used` (None: it reported nothing, the
        reservation stays spent) and learn from the provider's headers."""
        buckets = self.buckets(credential, model)
        self.dirty = True
        held = self._forget(reservation_id)
        if held is not None and used is not None:
            buckets.refill(self._clock())
            buckets.reconcile(held.wanted, {"requests": 1.0, **used})
        if headers:
            buckets.learn(_share_of(headers, self._share), self._clock())

    def let_go(self, run_id: str) -> int:
        """The run's lease left this replica's worker (an outcome, a lost lease, a stream that
        ended): its unsettled reservations give their tokens back. How many there were."""
        ids = self._by_run.pop(run_id, set())
        for reservation_id in ids:
            held = self._reservations.pop(reservation_id, None)
            if held is not None:
                self._landed(held.key)
                buckets = self.buckets(*held.key)
                buckets.refill(self._clock())
                buckets.release(held.wanted)
                self.dirty = True
        return len(ids)

    def _forget(self, reservation_id: int) -> Reservation | None:
        held = self._reservations.pop(reservation_id, None)
        if held is not None:
            self._landed(held.key)
            ids = self._by_run.get(held.run_id)
            if ids is not None:
                ids.discard(reservation_id)
                if not ids:
                    del self._by_run[held.run_id]
        return held

    def _landed(self, key: tuple[str, str]) -> None:
        left = self._in_flight.get(key, 0) - 1
        if left > 0:
            self._in_flight[key] = left
        else:
            self._in_flight.pop(key, None)

    @property
    def outstanding(self) -> int:
        """Reservations granted and not yet settled or let go."""
        return len(self._reservations)


def _scaled(limit: Limit, share: float) -> Limit:
    def part(value: int | None) -> int | None:
        return None if value is None else max(1, int(value * share))

    return Limit(
        part(limit.requests), part(limit.input_tokens), part(limit.output_tokens), limit.window_s
    )


def _share_of(headers: Headers, share: float) -> Headers:
    """The provider speaks for the whole pool: this replica keeps its share of it."""
    if share >= 1:
        return headers
    return Headers(
        {k: v * share for k, v in headers.limits.items()},
        {k: v * share for k, v in headers.remaining.items()},
        headers.retry_after_s,
        headers.full_in_s,
    )
