"""One Redis pub/sub connection that knows when it may have missed a message.

Redis carries hints only (see `tether.bus`), but a subscriber must know when some may have been
lost, to catch up from PostgreSQL. So a `Subscription` never lets redis-py reconnect behind its
back: a dropped connection is reported (`on_lost`) and made again with doubling backoff. It
pings, to notice a Redis that died or stalled without closing the socket. And it counts a
connection live (`on_live`) only once Redis confirmed its subscriptions: a sentinel channel
subscribed last answers for everything asked before it, because Redis answers one connection's
commands in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as redis
from redis.asyncio.client import PubSub
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from tether.hints import SENTINEL_CHANNEL

log = logging.getLogger(__name__)

PING_INTERVAL_S = 5.0
# A connection that answered nothing, not even a ping, for this many ping intervals is dead.
MISSED_PINGS = 3
# Reconnect backoff: doubling from the first to the last; the first again after a live spell.
RECONNECT_FIRST_S = 0.05
RECONNECT_MAX_S = 2.0
# Retry nothing inside redis-py (not even the one reconnect its default policy makes): every
# dropped connection must reach the loop, which alone knows that messages may have been lost.
_NO_RETRY = Retry(NoBackoff(), 0, supported_errors=())


@dataclass(frozen=True)
class Published:
    """One message as Redis delivered it; `pattern` is the pattern it matched, or ""."""

    channel: str
    data: bytes
    pattern: str = ""


def _nothing(*_: object) -> None:
    return None


class Subscription:
    """Channels and patterns received over one Redis connection for as long as `run()` runs.

    Callbacks run on the event loop and must not block: `on_message` for every message,
    `on_live` when a connection's first subscriptions are confirmed (whatever was published
    before is not delivered), `on_lost` when a live connection is lost (whatever is published
    until the next `on_live` is not delivered), `on_confirmed` with each channel or pattern Redis
    confirms. An exception from a callback is a bug: it ends `run()`.
    """

    def __init__(
        self,
        url: str,
        name: str,
        on_message: Callable[[Published], None],
        *,
        channels: Iterable[str] = (),
        patterns: Iterable[str] = (),
        on_live: Callable[[], None] = _nothing,
        on_lost: Callable[[], None] = _nothing,
        on_confirmed: Callable[[str], None] = _nothing,
        ping_interval_s: float = PING_INTERVAL_S,
        reconnect_max_s: float = RECONNECT_MAX_S,
    ) -> None:
        if not name or " " in name:
            raise ValueError(f"{name!r}: a subscription's name is its Redis client name")
        self.url = url
        self.name = name
        self._on_message = on_message
        self._on_live = on_live
        self._on_lost = on_lost
        self._on_confirmed = on_confirmed
        self._ping_interval = ping_interval_s
        self._reconnect_max = reconnect_max_s
        self._channels = _Names(channels)
        self._patterns = _Names(patterns)
        self._changed = asyncio.Event()
        self._live = False
        self._outage_reported = False
        self._heard = 0.0

    @property
    def live(self) -> bool:
        """Whether the connection is up and its first subscriptions are confirmed."""
        return self._live

    def is_subscribed(self, channel: str) -> bool:
        """Whether everything published on `channel` from now on is delivered."""
        return self._live and self._channels.carried(channel)

    async def subscribe(self, channel: str, *, wait_s: float = 0.0) -> bool:
        """Receive `channel` from now on (again on every new connection). While the connection
        is live, wait at most `wait_s` for Redis to confirm it; returns `is_subscribed`."""
        return await self._add(self._channels, channel, wait_s)

    async def psubscribe(self, pattern: str, *, wait_s: float = 0.0) -> bool:
        """Receive every channel matching `pattern`, as `subscribe` does a channel; returns
        whether the pattern is confirmed."""
        return await self._add(self._patterns, pattern, wait_s)

    def unsubscribe(self, channel: str) -> None:
        """Stop receiving `channel` (a message already on its way may still arrive)."""
        self._channels.discard(channel)
        self._changed.set()

    def punsubscribe(self, pattern: str) -> None:
        """Stop receiving the channels matching `pattern`."""
        self._patterns.discard(pattern)
        self._changed.set()

    async def _add(self, names: _Names, name: str, wait_s: float) -> bool:
        if name not in names.wanted:
            names.wanted.add(name)
            self._changed.set()
        if self._live and not names.carried(name) and wait_s > 0:
            await names.confirmation(name, wait_s)
        return self._live and names.carried(name)

    # -- the connection -------------------------------------------------------------------------

    async def run(self) -> None:
        """Stay subscribed, reconnecting whenever Redis goes away, until cancelled."""
        delay = RECONNECT_FIRST_S
        while True:
            client = redis.Redis.from_url(
                self.url, retry=_NO_RETRY, socket_connect_timeout=1.0, client_name=self.name
            )
            pubsub = client.pubsub()
            try:
                await self._connect(pubsub)
                await self._serve(pubsub)
            except (RedisError, OSError) as exc:
                self._report(exc)
            finally:
                was_live = self._reset()
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]  # redis-py: untyped
                    await client.aclose()
            if was_live:
                delay = RECONNECT_FIRST_S
                self._on_lost()
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._reconnect_max)

    async def _connect(self, pubsub: PubSub) -> None:
        """Ask for every wanted pattern and channel, then the sentinel."""
        self._heard = asyncio.get_running_loop().time()
        try:
            # Connecting waits for Redis's answers (the handshake); a stalled Redis never gives
            # them, and no ping can tell before the connection exists.
            async with asyncio.timeout(MISSED_PINGS * self._ping_interval):
                patterns, _ = self._patterns.changes()
                if patterns:
                    await pubsub.psubscribe(*patterns)
                channels, _ = self._channels.changes()
                await pubsub.subscribe(*channels, SENTINEL_CHANNEL)
        except TimeoutError as exc:
            raise RedisConnectionError("Redis did not answer the connection") from exc

    async def _serve(self, pubsub: PubSub) -> None:
        """Read and write until either fails; raise its failure.

        Not a TaskGroup: one raises its children's errors in place of a cancellation that comes
        while they fail, and `run()` would take that for a lost connection and go on."""
        tasks = [
            asyncio.create_task(self._read(pubsub), name=f"{self.name}-reader"),
            asyncio.create_task(self._write(pubsub), name=f"{self.name}-writer"),
        ]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
            failures = [task.exception() for task in tasks if not task.cancelled()]
        # Both loops run until they raise: whichever ended first did.
        raise next(failure for failure in failures if failure is not None)

    async def _write(self, pubsub: PubSub) -> None:
        """Subscribe and unsubscribe as wanted names change; ping to notice a silent death."""
        loop = asyncio.get_running_loop()
        last_ping = loop.time()
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(last_ping + self._ping_interval):
                    await self._changed.wait()
            self._changed.clear()  # before reading the changes: a later one sets it again
            add, drop = self._patterns.changes()
            if add:
                await pubsub.psubscribe(*add)
            if drop:
                await pubsub.punsubscribe(*drop)
            add, drop = self._channels.changes()
            if add:
                await pubsub.subscribe(*add)
            if drop:
                await pubsub.unsubscribe(*drop)
            now = loop.time()
            if now - self._heard > MISSED_PINGS * self._ping_interval:
                raise RedisConnectionError("Redis stopped answering pings")
            if now - last_ping >= self._ping_interval:
                await pubsub.ping()
                last_ping = now

    async def _read(self, pubsub: PubSub) -> None:
        loop = asyncio.get_running_loop()
        while True:
            message: dict[str, Any] | None = await pubsub.get_message(timeout=None)
            self._heard = loop.time()  # any answer, a pong included, shows Redis is there
            if message is not None:
                self._take(message)

    def _take(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        name = _text(message["channel"])
        if kind == "message":
            self._on_message(Published(name, message["data"]))
        elif kind == "pmessage":
            self._on_message(Published(name, message["data"], _text(message["pattern"])))
        elif kind == "subscribe" and name == SENTINEL_CHANNEL:
            self._went_live()
        elif kind in ("subscribe", "unsubscribe", "psubscribe", "punsubscribe"):
            names = self._patterns if kind.startswith("p") else self._channels
            if names.answered(name, subscribed="unsubscribe" not in kind):
                self._on_confirmed(name)

    def _went_live(self) -> None:
        self._live = True
        self._outage_reported = False
        log.info(
            "%s subscribed (%d channels, %d patterns)",
            self.name,
            len(self._channels.confirmed),
            len(self._patterns.confirmed),
        )
        self._on_live()

    def _report(self, cause: BaseException) -> None:
        if self._live:
            log.warning("%s lost Redis (%s); resubscribing", self.name, cause)
        elif not self._outage_reported:
            log.warning("%s cannot reach Redis (%s); retrying", self.name, cause)
        else:
            log.debug("%s still cannot reach Redis (%s)", self.name, cause)
        self._outage_reported = True

    def _reset(self) -> bool:
        """Forget the connection; whether it was live."""
        was_live, self._live = self._live, False
        self._channels.reset()
        self._patterns.reset()
        return was_live


class _Names:
    """One kind of name (channels or patterns): those wanted, those the connection was asked
    for, and those Redis confirmed."""

    def __init__(self, wanted: Iterable[str]) -> None:
        self.wanted = set(wanted)
        self.confirmed: set[str] = set()
        self._asked: set[str] = set()
        # Commands sent for a name and not yet answered: a name is confirmed only when the last
        # of them is answered and was a subscribe (Redis answers in order).
        self._unanswered: dict[str, int] = {}
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}

    def changes(self) -> tuple[list[str], list[str]]:
        """The names to subscribe and to unsubscribe, counted as sent."""
        add = sorted(self.wanted - self._asked)
        drop = sorted(self._asked - self.wanted)
        self._asked = set(self.wanted)
        for name in (*add, *drop):
            self._unanswered[name] = self._unanswered.get(name, 0) + 1
            self.confirmed.discard(name)
        return add, drop

    def carried(self, name: str) -> bool:
        """Whether `name` is wanted and confirmed (once unwanted, Redis may drop it any time)."""
        return name in self.wanted and name in self.confirmed

    def answered(self, name: str, *, subscribed: bool) -> bool:
        """Count Redis's answer to one command for `name`; whether it is now confirmed."""
        left = self._unanswered.pop(name, 1) - 1
        if left > 0:
            self._unanswered[name] = left
            return False
        if not subscribed:
            return False
        self.confirmed.add(name)
        self._release(name)
        return True

    def discard(self, name: str) -> None:
        """No longer want `name`; whoever waits for its confirmation stops waiting."""
        self.wanted.discard(name)
        self._release(name)

    def reset(self) -> None:
        """The connection is gone: nothing is asked or confirmed, nobody waits."""
        self._asked.clear()
        self._unanswered.clear()
        self.confirmed.clear()
        for name in list(self._waiters):
            self._release(name)

    async def confirmation(self, name: str, wait_s: float) -> None:
        """Wait at most `wait_s` for `name` to be confirmed (or the connection lost)."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters = self._waiters.setdefault(name, [])
        waiters.append(waiter)
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await waiter
        finally:
            if waiter in waiters:
                waiters.remove(waiter)
            if not waiters and self._waiters.get(name) is waiters:
                del self._waiters[name]

    def _release(self, name: str) -> None:
        for waiter in self._waiters.pop(name, []):
            if not waiter.done():
                waiter.set_result(None)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")
