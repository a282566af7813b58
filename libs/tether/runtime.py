"""Shared runtime helpers for every service: supervised background tasks, periodic rounds, and
a Redis subscription that survives Redis going away."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio.client import PubSub
from redis.exceptions import RedisError

from tether.bus import Bus

log = logging.getLogger(__name__)

# Reconnect backoff of a lost subscription: doubling from the first to the last.
RECONNECT_FIRST_S = 0.05
RECONNECT_MAX_S = 2.0


async def every(interval_s: float, work: Callable[[], Awaitable[int]], name: str) -> None:
    """Run `work` every `interval_s`, logging (not dying on) a failed round."""
    while True:
        try:
            await work()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s round failed; retrying next interval", name)
        await asyncio.sleep(interval_s)


async def listen_forever(
    bus: Bus,
    what: str,
    subscribe: Callable[[PubSub], Awaitable[Any]],
    handle: Callable[[dict[str, Any]], None],
    *,
    on_lost: Callable[[], None] = lambda: None,
) -> None:
    """Subscribe with `subscribe` and pass every published message to `handle`, for ever. When
    Redis goes away the loss is logged, `on_lost` runs (whatever was published meanwhile is
    gone: a listener catches up from PostgreSQL) and the subscription is made again, with
    backoff."""
    delay = RECONNECT_FIRST_S
    while True:
        try:
            async with bus.client.pubsub() as pubsub:
                await subscribe(pubsub)
                delay = RECONNECT_FIRST_S
                async for message in pubsub.listen():
                    if message.get("type") in ("message", "pmessage"):
                        handle(message)
        except (RedisError, OSError) as exc:
            log.warning("%s lost Redis (%s); reconnecting", what, exc)
            on_lost()
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECONNECT_MAX_S)


class Supervisor:
    """Starts named background tasks; the first to die takes the service down."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[None]] = []
        self.failed = asyncio.Event()

    def start(self, name: str, coro: Awaitable[None]) -> None:
        """Run `coro` as a named, supervised task."""
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        task.add_done_callback(self._done)
        self.tasks.append(task)

    def _done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        log.critical("background task %s died: %r", task.get_name(), exc)
        self.failed.set()

    async def stop(self) -> None:
        """Cancel every task and wait for them."""
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
