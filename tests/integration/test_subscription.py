"""The shared Redis subscription against the real Redis: it delivers, confirms what it is asked
for, and notices (then repairs) a connection killed or stalled under it."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as redis

from tether.runtime.subscription import Published, Subscription
from tether.testing.eventually import eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")

WAIT_S = 10.0


class Reports:
    """What a subscription told its callbacks, in order, for the test to wait on."""

    def __init__(self) -> None:
        self.messages: asyncio.Queue[Published] = asyncio.Queue()
        self.states: asyncio.Queue[str] = asyncio.Queue()  # "live" and "lost"
        self.confirmed: list[str] = []

    def subscription(self, url: str, **options: object) -> Subscription:
        return Subscription(
            url,
            f"test-subscription-{uuid.uuid4().hex[:12]}",
            self.messages.put_nowait,
            on_live=lambda: self.states.put_nowait("live"),
            on_lost=lambda: self.states.put_nowait("lost"),
            on_confirmed=self.confirmed.append,
            **options,  # type: ignore[arg-type]  # the tests pass only Subscription's options
        )

    async def state(self) -> str:
        return await asyncio.wait_for(self.states.get(), WAIT_S)

    async def message(self) -> Published:
        return await asyncio.wait_for(self.messages.get(), WAIT_S)


@contextlib.asynccontextmanager
async def running(subscription: Subscription) -> AsyncIterator[None]:
    task = asyncio.create_task(subscription.run(), name=subscription.name)
    try:
        yield
        assert not task.done(), f"the subscription ended: {task.exception()!r}"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.fixture
async def admin(redis_url: str) -> AsyncIterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


def channel_name() -> str:
    return f"test:subscription:{uuid.uuid4().hex}"


async def test_messages_on_channels_and_patterns_are_handed_over(
    redis_url: str, admin: redis.Redis
) -> None:
    prefix = channel_name()
    reports = Reports()
    subscription = reports.subscription(redis_url, channels=[prefix], patterns=[prefix + ":*"])
    async with running(subscription):
        assert await reports.state() == "live"
        await admin.publish(prefix, "to the channel")
        await admin.publish(prefix + ":run-1", "to the pattern")
        assert await reports.message() == Published(prefix, b"to the channel")
        assert await reports.message() == Published(
            prefix + ":run-1", b"to the pattern", prefix + ":*"
        )
        assert reports.confirmed == [prefix + ":*", prefix]  # patterns are asked for first


async def test_a_channel_added_while_live_is_confirmed_before_subscribe_returns(
    redis_url: str, admin: redis.Redis
) -> None:
    channel, pattern_channel = channel_name(), channel_name()
    reports = Reports()
    subscription = reports.subscription(redis_url)
    async with running(subscription):
        assert await reports.state() == "live"
        assert not subscription.is_subscribed(channel)
        assert await subscription.subscribe(channel, wait_s=WAIT_S) is True
        assert await subscription.psubscribe(pattern_channel + "*", wait_s=WAIT_S) is True
        # Confirmed means subscribed on Redis's side: published from now on, it arrives.
        assert reports.confirmed == [channel, pattern_channel + "*"]
        assert subscription.is_subscribed(channel)
        await admin.publish(channel, "first")
        await admin.publish(pattern_channel + "x", "second")
        assert await reports.message() == Published(channel, b"first")
        assert await reports.message() == Published(
            pattern_channel + "x", b"second", pattern_channel + "*"
        )


async def test_an_unsubscribed_channel_is_no_longer_delivered(
    redis_url: str, admin: redis.Redis
) -> None:
    dropped, kept = channel_name(), channel_name()
    reports = Reports()
    subscription = reports.subscription(redis_url, channels=[dropped, kept])
    async with running(subscription):
        assert await reports.state() == "live"
        subscription.unsubscribe(dropped)
        assert not subscription.is_subscribed(dropped)

        async def dropped_on_redis() -> bool:
            [(_, subscribers)] = await admin.pubsub_numsub(dropped)
            return subscribers == 0

        await eventually(dropped_on_redis, what="Redis to drop the subscription")
        await admin.publish(dropped, "not for us")
        await admin.publish(kept, "for us")
        # Redis delivers in the order it received: had the first arrived, it would come first.
        assert await reports.message() == Published(kept, b"for us")
        assert subscription.is_subscribed(kept)


async def test_a_killed_connection_is_reported_lost_then_resubscribed(
    redis_url: str, admin: redis.Redis
) -> None:
    channel, added = channel_name(), channel_name()
    reports = Reports()
    subscription = reports.subscription(redis_url, channels=[channel])
    async with running(subscription):
        assert await reports.state() == "live"
        assert await subscription.subscribe(added, wait_s=WAIT_S)
        assert await kill_connection(admin, subscription) == 1
        assert await reports.state() == "lost"
        assert not subscription.is_subscribed(channel)
        assert await reports.state() == "live"
        # The new connection carries what was asked for before it and since.
        assert subscription.is_subscribed(channel) and subscription.is_subscribed(added)
        await admin.publish(added, "after the kill")
        assert await reports.message() == Published(added, b"after the kill")


async def test_a_connection_that_stops_answering_pings_is_declared_lost(
    redis_url: str, admin: redis.Redis
) -> None:
    channel = channel_name()
    reports = Reports()
    # Pings every 0.1 s: the stall below outlasts three missed ones many times over.
    subscription = reports.subscription(redis_url, channels=[channel], ping_interval_s=0.1)
    async with running(subscription):
        assert await reports.state() == "live"
        loop = asyncio.get_running_loop()
        paused_at = loop.time()
        # The socket stays open and silent: only the missing pongs can tell. (Commands,
        # this admin client's included, wait for the pause's end.)
        await admin.client_pause(3000)
        assert await reports.state() == "lost"
        assert loop.time() - paused_at < 3.0, "lost only when the pause ended"
        assert await reports.state() == "live"
        await admin.publish(channel, "after the stall")
        assert await reports.message() == Published(channel, b"after the stall")


async def kill_connection(admin: redis.Redis, subscription: Subscription) -> int:
    """Have Redis close the subscription's connection (found by its client name)."""
    clients = await admin.client_list(_type="pubsub")
    ids = [client["id"] for client in clients if client["name"] == subscription.name]
    for client_id in ids:
        await admin.client_kill_filter(_id=client_id)
    return len(ids)
