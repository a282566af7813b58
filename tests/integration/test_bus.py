"""The hint bus against the real Redis: `delivered` returns only once posted messages are out."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
import redis.asyncio as redis

from tether.bus import DELIVERY_WAIT_S, Bus
from tether.stack.embedded import EmbeddedRedis

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_delivered_returns_after_every_posted_message_reached_subscribers(
    redis_url: str,
) -> None:
    channel = f"test:bus:{uuid.uuid4().hex}"
    listener = redis.Redis.from_url(redis_url)
    bus = Bus(redis_url)
    try:
        async with listener.pubsub() as pubsub:
            await pubsub.subscribe(channel)
            await pubsub.get_message(timeout=1.0)  # the subscribe confirmation
            for i in range(300):
                bus.post(channel, str(i))
            await bus.delivered()
            # A marker sent on another connection after `delivered` returned reaches the
            # subscriber after all of them (Redis delivers in the order it received).
            await listener.publish(channel, "marker")
            received = []
            while (message := await pubsub.get_message(timeout=5.0)) is not None:
                if message["data"] == b"marker":
                    break
                received.append(int(message["data"]))
            assert received == list(range(300))
    finally:
        await bus.close()
        await listener.aclose()


async def test_delivered_gives_up_when_redis_is_unreachable() -> None:
    bus = Bus("redis://127.0.0.1:1/0")  # nothing listens on port 1: every connect is refused
    try:
        bus.post("test:bus:nowhere", "lost")
        loop = asyncio.get_running_loop()
        started = loop.time()
        delivered = await bus.delivered()
        waited = loop.time() - started
        # A refused publish settles its message at once: the caller is not held for the whole
        # DELIVERY_WAIT_S by a hint that can never go out, and is told it did not go out.
        assert (delivered, waited < DELIVERY_WAIT_S) == (False, True), f"waited {waited:.2f}s"
    finally:
        await bus.close()


async def test_delivered_reports_each_loss_once(redis_url: str) -> None:
    bus = Bus(redis_url)
    try:
        bus.post("test:bus:fine", "sent")
        assert await bus.delivered() is True
        assert await bus.delivered() is True, "nothing new posted, nothing lost"
    finally:
        await bus.close()


async def test_a_hint_posted_right_after_redis_restarted_goes_out(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis")
    bus = Bus(await server.start())
    try:
        bus.post("test:bus:before", "before")
        assert await bus.delivered()
        server.process.kill()  # the bus's pooled connection is now one Redis closed
        server.process.wait()
        listener = redis.Redis.from_url(await server.start())  # same port, same users
        async with listener, listener.pubsub() as pubsub:
            await pubsub.subscribe("test:bus:after")
            await pubsub.get_message(timeout=1.0)  # the subscribe confirmation
            bus.post("test:bus:after", "after")
            assert await bus.delivered(), "the first hint after the restart was given up on"
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5.0)
            assert message is not None and message["data"] == b"after"
    finally:
        await bus.close()
        server.stop()
