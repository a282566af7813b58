"""The orchestrator's background loops: the lease reaper, the retry scheduler and the Redis
wake-up listener. Each is supervised: if one dies, the service stops loudly."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from redis.exceptions import RedisError

from services.orchestrator.execution import Execution
from tether.bus import Bus
from tether.hints import WAKE_CHANNEL, decode_wake

log = logging.getLogger(__name__)


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


async def listen_for_wakeups(bus: Bus, execution: Execution) -> None:
    """Wake waiting claims when admission or another replica queues a run."""
    while True:
        try:
            async with bus.client.pubsub() as pubsub:
                await pubsub.subscribe(WAKE_CHANNEL)
                async for message in pubsub.listen():
                    if message.get("type") != "message":
                        continue
                    run_id, origin = decode_wake(message.get("data") or "")
                    if origin != execution.wake_marker:  # this replica woke its own already
                        execution.wakeups.wake([run_id])
        except asyncio.CancelledError:
            raise
        except (RedisError, OSError) as exc:
            # Claims fall back to polling meanwhile; nothing is lost, only slower.
            log.warning("wake-up listener lost Redis (%s); reconnecting", exc)
            execution.wakeups.wake_all()
            await asyncio.sleep(0.5)


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
