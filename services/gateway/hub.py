"""The live tail: one Redis pub/sub connection per gateway process, fanned out to its streams.

Every open stream holds a `Feed`, a bounded local buffer. The hub subscribes the shared
connection to a run's channel while some feed follows that run (and for a short linger after,
so a refreshing client finds it still subscribed), and copies each message into the feeds of
that run without ever waiting on one: a feed that is full is detached and told it overflowed,
so a slow client never delays the others or the publisher.

Redis carries hints only. When the connection drops (Redis flushed of clients, restarted,
unreachable), every feed is told to re-read PostgreSQL (`Signal.RESYNC`) and, until the hub is
subscribed again, streams poll PostgreSQL instead (`EventHub.is_live` is False).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import redis.asyncio as redis
from redis.asyncio.client import PubSub
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from tether.convert import event_to_proto
from tether.hints import LiveMessage, decode_event, events_channel
from tether.v1 import events_pb2

log = logging.getLogger(__name__)

# Subscribed last on every connection: its confirmation means every channel before it is live.
SENTINEL_CHANNEL = "tether:gateway:hub"
_DELTA = "text.delta"


class Signal(enum.Enum):
    """What a feed yields besides events."""

    RESYNC = "resync"  # live messages may have been lost: re-read PostgreSQL
    OVERFLOWED = "overflowed"  # the consumer fell behind; its feed was detached
    CLOSED = "closed"  # the gateway is stopping


class LiveEvent:
    """One message from Redis, decoded once and shared by every feed that receives it.

    The protobuf form is built on first use; `encoded` memoises per-transport encodings (the
    gRPC response, the SSE frame) so a fan-out to many streams encodes once.
    """

    __slots__ = ("_event", "_message", "encoded", "run_id", "seq", "type")

    def __init__(self, message: LiveMessage) -> None:
        self._message = message
        self.run_id = message.run_id
        self.seq = message.seq
        self.type = message.type
        self._event: events_pb2.RunEvent | None = None
        self.encoded: dict[str, Any] = {}

    @property
    def event(self) -> events_pb2.RunEvent:
        """The transport event."""
        if self._event is None:
            created = self._message.created_at
            when = datetime.fromisoformat(created) if created else datetime.now(UTC)
            self._event = event_to_proto(
                self.run_id, self.seq, self.type, self._message.payload, when
            )
        return self._event

    def memo(self, key: str, encode: Callable[[LiveEvent], Any]) -> Any:
        """`encode(self)`, computed once per key."""
        value = self.encoded.get(key)
        if value is None:
            value = self.encoded[key] = encode(self)
        return value


Item = LiveEvent | Signal


class Feed:
    """One stream's view of the hub: a bounded buffer of live events and signals."""

    def __init__(self, capacity: int, *, deltas: bool) -> None:
        self.deltas = deltas
        self.channels: set[str] = set()
        # Channels followed before Redis confirmed them: a RESYNC is due once it does.
        self.unconfirmed: set[str] = set()
        self._queue: asyncio.Queue[Item] = asyncio.Queue(max(capacity, 1))
        self._resync = False
        self._overflowed = False
        self._closed = False

    def offer(self, item: LiveEvent) -> bool:
        """Buffer `item` without waiting; False (and the feed overflowed) when it is full."""
        if self._overflowed:
            return False
        try:
            self._queue.put_nowait(item)
        except asyncio.QueueFull:
            self._overflowed = True
            return False
        return True

    def signal(self, signal: Signal) -> None:
        """Raise a signal; it overtakes buffered events."""
        if signal is Signal.RESYNC:
            self._resync = True
        elif signal is Signal.CLOSED:
            self._closed = True
        # Wake a consumer blocked on an empty buffer; a full one is not blocked.
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(signal)

    async def next(self, wait_s: float) -> Item | None:
        """The next signal or event; None when nothing arrived within `wait_s` seconds."""
        deadline = asyncio.get_running_loop().time() + max(wait_s, 0.0)
        while True:
            if self._closed:
                return Signal.CLOSED
            if self._overflowed:
                return Signal.OVERFLOWED
            if self._resync:
                self._resync = False
                return Signal.RESYNC
            try:
                async with asyncio.timeout_at(deadline):
                    item = await self._queue.get()
            except TimeoutError:
                return None
            if item is not Signal.RESYNC:
                return item
            # A RESYNC wake-up whose flag was already consumed above: nothing more to do.


class EventHub:
    """Shares one Redis subscription among every stream of this process."""

    def __init__(
        self,
        redis_url: str,
        *,
        feed_capacity: int = 1024,
        linger_s: float = 5.0,
        ping_interval_s: float = 5.0,
        confirm_timeout_s: float = 1.0,
        reconnect_max_s: float = 2.0,
    ) -> None:
        self._url = redis_url
        self._capacity = feed_capacity
        self._linger = linger_s
        self._ping_interval = ping_interval_s
        self._confirm_timeout = confirm_timeout_s
        self._reconnect_max = reconnect_max_s
        self._feeds: set[Feed] = set()
        self._by_channel: dict[str, set[Feed]] = {}
        # Channels the connection should carry (followed, or lingering after their last feed).
        self._wanted: set[str] = set()
        self._idle_since: dict[str, float] = {}
        # What this connection was asked for, and what Redis confirmed.
        self._requested: set[str] = set()
        self._confirmed: set[str] = set()
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}
        self._changed = asyncio.Event()
        self._healthy = False
        self._closed = False
        self._heard = 0.0
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self, on_death: Callable[[], None] | None = None) -> None:
        """Connect in the background; `on_death` runs if the hub's task dies of a bug."""
        if not self._url:
            log.warning("no Redis URL: streams follow runs by polling PostgreSQL only")
            return
        self._task = asyncio.create_task(self._run(), name="event-hub")

        def done(task: asyncio.Task[None]) -> None:
            if task.cancelled():
                return
            log.critical("event hub died: %r", task.exception())
            if on_death is not None:
                on_death()

        self._task.add_done_callback(done)

    def close_feeds(self) -> None:
        """End every stream (the gateway is stopping); new feeds start closed."""
        self._closed = True
        for feed in list(self._feeds):
            feed.signal(Signal.CLOSED)

    async def stop(self) -> None:
        """Close the feeds and the connection."""
        self.close_feeds()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # -- feeds ----------------------------------------------------------------------------------

    def open(self, *, deltas: bool) -> Feed:
        """A new feed following nothing yet."""
        feed = Feed(self._capacity, deltas=deltas)
        self._feeds.add(feed)
        if self._closed:
            feed.signal(Signal.CLOSED)
        return feed

    def close(self, feed: Feed) -> None:
        """Stop feeding `feed`."""
        self._feeds.discard(feed)
        for channel in list(feed.channels):
            self._detach(feed, channel)

    def is_live(self, run_id: str) -> bool:
        """Whether the run's live tail is flowing (else its streams must poll PostgreSQL)."""
        return self._healthy and events_channel(run_id) in self._confirmed

    async def follow(self, feed: Feed, run_id: str) -> bool:
        """Feed `feed` the run's live events, once Redis confirms the subscription (so nothing
        published after this returns is missed). Returns whether the tail is live."""
        channel = events_channel(run_id)
        feed.channels.add(channel)
        self._by_channel.setdefault(channel, set()).add(feed)
        self._idle_since.pop(channel, None)
        if channel not in self._wanted:
            self._wanted.add(channel)
            self._changed.set()
        if not self._healthy or channel in self._confirmed:
            return self.is_live(run_id)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(channel, []).append(waiter)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._confirm_timeout):
                await waiter
        if not self.is_live(run_id):
            feed.unconfirmed.add(channel)
        return self.is_live(run_id)

    def unfollow(self, feed: Feed, run_id: str) -> None:
        """Stop feeding `feed` this run's events."""
        self._detach(feed, events_channel(run_id))

    def _detach(self, feed: Feed, channel: str) -> None:
        feed.channels.discard(channel)
        feed.unconfirmed.discard(channel)
        feeds = self._by_channel.get(channel)
        if feeds is None:
            return
        feeds.discard(feed)
        if not feeds:
            del self._by_channel[channel]
            self._idle_since[channel] = asyncio.get_running_loop().time()

    # -- the connection -------------------------------------------------------------------------

    async def _run(self) -> None:
        delay = 0.05
        while True:
            # No silent reconnects inside redis-py: a dropped connection must be seen, because
            # whatever was published meanwhile is lost and the feeds must re-read PostgreSQL.
            client = redis.Redis.from_url(
                self._url, retry=Retry(NoBackoff(), 0), socket_connect_timeout=1.0
            )
            pubsub = client.pubsub()
            try:
                self._heard = asyncio.get_running_loop().time()
                self._requested = set(self._wanted)
                await pubsub.subscribe(*sorted(self._requested), SENTINEL_CHANNEL)
                async with asyncio.TaskGroup() as group:
                    group.create_task(self._read(pubsub), name="event-hub-reader")
                    group.create_task(self._write(pubsub), name="event-hub-writer")
            except* (RedisError, OSError) as failure:
                if self._healthy:
                    cause = failure.exceptions[0]
                    log.warning("event hub lost Redis (%s); streams poll PostgreSQL", cause)
            finally:
                if self._healthy:
                    delay = 0.05
                self._lost()
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]  # redis-py: untyped
                    await client.aclose()
            await asyncio.sleep(delay)  # reconnect backoff
            delay = min(delay * 2, self._reconnect_max)

    def _lost(self) -> None:
        was_healthy = self._healthy
        self._healthy = False
        self._requested.clear()
        self._confirmed.clear()
        for waiters in self._waiters.values():
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
        self._waiters.clear()
        if was_healthy:
            for feed in list(self._feeds):
                feed.signal(Signal.RESYNC)

    async def _write(self, pubsub: PubSub) -> None:
        """Subscribe and unsubscribe as feeds come and go; ping to notice a silent death."""
        loop = asyncio.get_running_loop()
        last_ping = loop.time()
        while True:
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(self._ping_interval, max(self._linger, 0.05))):
                    await self._changed.wait()
            now = loop.time()
            for channel, since in list(self._idle_since.items()):
                if now - since >= self._linger:
                    del self._idle_since[channel]
                    self._wanted.discard(channel)
            add = self._wanted - self._requested
            drop = self._requested - self._wanted
            self._requested = set(self._wanted)
            if add:
                await pubsub.subscribe(*sorted(add))
            if drop:
                await pubsub.unsubscribe(*sorted(drop))
            if now - self._heard > 3 * self._ping_interval:
                raise RedisConnectionError("Redis stopped answering pings")
            if now - last_ping >= self._ping_interval:
                await pubsub.ping()
                last_ping = now

    async def _read(self, pubsub: PubSub) -> None:
        loop = asyncio.get_running_loop()
        while True:
            message = await pubsub.get_message(timeout=None)
            self._heard = loop.time()
            if message is None:
                continue
            kind = message["type"]
            channel = _text(message.get("channel"))
            if kind == "message":
                self._dispatch(channel, message["data"])
            elif kind == "subscribe":
                self._confirm(channel)
            elif kind == "unsubscribe":
                self._confirmed.discard(channel)

    def _confirm(self, channel: str) -> None:
        if channel == SENTINEL_CHANNEL:
            # Every channel of the connection's first SUBSCRIBE is live now: whatever feeds
            # missed while the tail was down, they read from PostgreSQL.
            self._healthy = True
            for feed in list(self._feeds):
                feed.signal(Signal.RESYNC)
            log.info("event hub subscribed (%d runs followed)", len(self._requested))
        self._confirmed.add(channel)
        for waiter in self._waiters.pop(channel, []):
            if not waiter.done():
                waiter.set_result(None)
        for feed in self._by_channel.get(channel, ()):
            if channel in feed.unconfirmed:
                feed.unconfirmed.discard(channel)
                feed.signal(Signal.RESYNC)

    def _dispatch(self, channel: str, data: Any) -> None:
        feeds = self._by_channel.get(channel)
        if not feeds:
            return
        try:
            live = LiveEvent(decode_event(data))
        except ValueError as exc:
            log.warning("dropping an undecodable message on %s: %s", channel, exc)
            return
        delta = live.type == _DELTA
        for feed in list(feeds):
            if delta and not feed.deltas:
                continue
            if not feed.offer(live):
                self.close(feed)
                feed.signal(Signal.OVERFLOWED)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")
