"""The live tail: one Redis pub/sub connection per gateway process, fanned out to its streams.

Every open stream holds a `Feed`, a bounded local buffer. The hub subscribes the shared
connection to a run's channel while some feed follows that run (and for a short linger after,
so a refreshing client finds it still subscribed), and copies each message into the feeds of
that run without ever waiting on one: a feed that is full is detached and told it overflowed,
so a slow client never delays the others or the publisher.

Redis carries hints only. When the connection drops (Redis flushed of clients, restarted,
unreachable), every feed is told to re-read PostgreSQL (`Signal.RESYNC`) and, until the hub is
subscribed again, streams poll PostgreSQL instead (`EventHub.is_live` is False). The connection
itself, its liveness and its reconnects are a `tether.runtime.subscription.Subscription`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from tether import telemetry
from tether.convert import event_to_proto
from tether.domain import EventType
from tether.hints import EVENTS_PATTERN, LiveMessage, decode_events, events_channel
from tether.runtime.subscription import Published, Subscription
from tether.runtime.tasks import Supervisor
from tether.telemetry import metrics
from tether.v1 import events_pb2
from tether.visibility import Viewer

log = logging.getLogger(__name__)


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
            message = self._message
            self._event = event_to_proto(
                self.run_id, self.seq, self.type, message.payload, when, format=message.format
            )
        return self._event

    def memo(self, key: str, encode: Callable[[LiveEvent], Any]) -> Any:
        """`encode(self)`, computed once per key."""
        value = self.encoded.get(key)
        if value is None:
            value = self.encoded[key] = encode(self)
        return value


Item = LiveEvent | Signal


class RunsWatch:
    """A live run list's view of the hub: which runs its caller may see had a durable event
    since it last looked (run ids only: the list re-reads what its caller may see)."""

    # More changed runs than this between two looks: the list re-reads as after a RESYNC.
    CAPACITY = 4096

    def __init__(self, viewer: Viewer) -> None:
        self.viewer = viewer
        self._changed: set[str] = set()
        self._resync = False
        self._closed = False
        self._woken = asyncio.Event()

    def touch(self, run_id: str) -> None:
        """A run changed."""
        if len(self._changed) >= self.CAPACITY:
            self._resync = True
        else:
            self._changed.add(run_id)
        self._woken.set()

    def signal(self, signal: Signal) -> None:
        """Live messages may have been lost (RESYNC), or the gateway is stopping (CLOSED)."""
        if signal is Signal.CLOSED:
            self._closed = True
        else:
            self._resync = True
        self._woken.set()

    @property
    def closed(self) -> bool:
        """Whether the gateway is stopping."""
        return self._closed

    async def next(self, wait_s: float) -> tuple[set[str], bool] | None:
        """The runs changed since the last call and whether any other may have (a RESYNC);
        None when nothing arrived within `wait_s` seconds."""
        try:
            async with asyncio.timeout(max(wait_s, 0.0)):
                await self._woken.wait()
        except TimeoutError:
            return None
        self._woken.clear()
        changed, resync = self._changed, self._resync
        self._changed, self._resync = set(), False
        return changed, resync


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
        self._capacity = feed_capacity
        self._linger = linger_s
        self._confirm_timeout = confirm_timeout_s
        self._feeds: set[Feed] = set()
        self._by_channel: dict[str, set[Feed]] = {}
        # Channels no feed follows any more, still subscribed until their timer ends the linger.
        self._lingering: dict[str, asyncio.TimerHandle] = {}
        self._subscription = Subscription(
            redis_url,
            "event-hub",
            self._dispatch,
            on_live=self._resync_all,
            on_lost=self._resync_all,
            on_confirmed=self._confirmed,
            ping_interval_s=ping_interval_s,
            reconnect_max_s=reconnect_max_s,
        )
        self._watches: set[RunsWatch] = set()
        # The same watches by their caller's tenant: a run's event wakes only its tenant's.
        self._watches_of: dict[str, set[RunsWatch]] = {}
        self._closed = False

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self, supervisor: Supervisor) -> None:
        """Connect in the background, as a task of `supervisor` (its death stops the gateway)."""
        if not self._subscription.url:
            log.warning("no Redis URL: streams follow runs by polling PostgreSQL only")
            return
        supervisor.start("event-hub", self._subscription.run())

    def close_feeds(self) -> None:
        """End every stream (the gateway is stopping); new feeds start closed."""
        self._closed = True
        for feed in list(self._feeds):
            feed.signal(Signal.CLOSED)
        for watch in list(self._watches):
            watch.signal(Signal.CLOSED)

    async def stop(self) -> None:
        """Close the feeds and end the lingers (the connection is the supervisor's to stop)."""
        self.close_feeds()
        for timer in self._lingering.values():
            timer.cancel()
        self._lingering.clear()

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

    def open_feeds(self) -> int:
        """How many streams follow runs through this hub now."""
        return len(self._feeds)

    def is_live(self, run_id: str) -> bool:
        """Whether the run's live tail is flowing (else its streams must poll PostgreSQL)."""
        return self._subscription.is_subscribed(events_channel(run_id))

    async def follow(self, feed: Feed, run_id: str) -> bool:
        """Feed `feed` the run's live events, once Redis confirms the subscription (so nothing
        published after this returns is missed). Returns whether the tail is live."""
        channel = events_channel(run_id)
        feed.channels.add(channel)
        self._by_channel.setdefault(channel, set()).add(feed)
        lingering = self._lingering.pop(channel, None)
        if lingering is not None:
            lingering.cancel()
        live = await self._subscription.subscribe(channel, wait_s=self._confirm_timeout)
        if not live and channel in feed.channels:
            feed.unconfirmed.add(channel)
        return live

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
            self._lingering[channel] = asyncio.get_running_loop().call_later(
                self._linger, self._linger_over, channel
            )

    def _linger_over(self, channel: str) -> None:
        del self._lingering[channel]
        self._subscription.unsubscribe(channel)

    # -- the live run lists -----------------------------------------------------------------------

    def watch_runs(self, viewer: Viewer) -> RunsWatch:
        """A new watch of the durable events of the runs `viewer` may see (the hub receives
        every run's while some watch is open); `hear_every_run` confirms it. Close it with
        `unwatch_runs`."""
        watch = RunsWatch(viewer)
        self._watches.add(watch)
        self._watches_of.setdefault(viewer.tenant_id, set()).add(watch)
        if self._closed:
            watch.signal(Signal.CLOSED)
        return watch

    async def hear_every_run(self) -> bool:
        """Subscribe to every run's events for the open watches; returns whether Redis
        confirmed it (else they must poll)."""
        return await self._subscription.psubscribe(EVENTS_PATTERN, wait_s=self._confirm_timeout)

    def unwatch_runs(self, watch: RunsWatch) -> None:
        """Close a watch; the last one closed stops receiving every run's events."""
        self._watches.discard(watch)
        tenants = self._watches_of.get(watch.viewer.tenant_id)
        if tenants is not None:
            tenants.discard(watch)
            if not tenants:
                del self._watches_of[watch.viewer.tenant_id]
        if not self._watches:
            self._subscription.punsubscribe(EVENTS_PATTERN)

    def watching_live(self) -> bool:
        """Whether the watches hear every run's events now (else they must poll)."""
        return self._subscription.live

    def _touch_watches(self, message: Published) -> None:
        try:
            decoded = decode_events(message.data)
        except ValueError:
            return
        # Deltas (seq 0) change nothing a list shows.
        if not any(one.seq for one in decoded):
            return
        run = decoded[0]
        if run.audience is None:
            # Whose run it is was not said (the release before): any list may show it.
            for watch in list(self._watches):
                watch.touch(run.run_id)
            return
        tenant, owner = run.audience.tenant_id, run.audience.owner_principal_id
        for watch in list(self._watches_of.get(tenant, ())):
            if watch.viewer.may_see(tenant, owner):
                watch.touch(run.run_id)

    # -- what the subscription reports ----------------------------------------------------------

    def _resync_all(self) -> None:
        # Lost: streams poll PostgreSQL until the hub is back. Live (again): whatever the feeds
        # missed while the tail was down, they read from PostgreSQL.
        for feed in list(self._feeds):
            feed.signal(Signal.RESYNC)
        for watch in list(self._watches):
            watch.signal(Signal.RESYNC)

    def _confirmed(self, channel: str) -> None:
        for feed in list(self._by_channel.get(channel, ())):
            if channel in feed.unconfirmed:
                feed.unconfirmed.discard(channel)
                feed.signal(Signal.RESYNC)

    def _dispatch(self, message: Published) -> None:
        if message.pattern:
            # Every run's events, for the live lists (a followed run's come on its channel too).
            self._touch_watches(message)
            return
        feeds = self._by_channel.get(message.channel)
        if not feeds:
            return
        try:
            decoded = decode_events(message.data)
        except ValueError as exc:
            log.warning("dropping an undecodable message on %s: %s", message.channel, exc)
            return
        for one in decoded:
            live = LiveEvent(one)
            delta = live.type == EventType.TEXT_DELTA
            for feed in list(feeds):
                if delta and not feed.deltas:
                    continue
                if not feed.offer(live):
                    self.close(feed)
                    feed.signal(Signal.OVERFLOWED)
                    if telemetry.on:
                        metrics.slow_consumer_cut()
