"""Shared runtime helpers for every service: supervised background tasks, and rounds that sleep
until their next deadline (the Redis subscription that survives Redis going away is
`tether.runtime.subscription`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


async def rounds(
    work: Callable[[], Awaitable[float | None]],
    name: str,
    *,
    least_s: float,
    most_s: float,
    nudge: asyncio.Event | None = None,
) -> None:
    """Run `work` again when it is next due: `work` returns the seconds until then (None: it
    knows of nothing due), waited for no less than `least_s` (something overdue that must wait,
    like a lease still held, is not spun on) and no more than `most_s` (what it cannot see
    coming: work made elsewhere, which is due no sooner than `most_s` from now). `nudge`,
    set by whoever makes work here, starts a round at once. An idle service thus looks once
    per `most_s`, not every `least_s`. A failed round is logged and tried again after
    `least_s`."""
    while True:
        if nudge is not None:
            nudge.clear()  # before the round: a nudge during it starts the next one
        wait_s = least_s
        try:
            due_in = await work()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s round failed; trying again in %.1f s", name, least_s)
        else:
            wait_s = most_s if due_in is None else min(max(due_in, least_s), most_s)
        if nudge is None:
            await asyncio.sleep(wait_s)
            continue
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                await nudge.wait()


class Supervisor:
    """Starts named background tasks; the first to die takes the service down. A task dies when
    it raises, or returns before the service began to stop (a loop that gave up silently)."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[None]] = []
        self.failed = asyncio.Event()
        self._stopping = False

    def start(self, name: str, coro: Awaitable[None]) -> None:
        """Run `coro` as a named, supervised task."""
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        task.add_done_callback(self._done)
        self.tasks.append(task)

    def stopping(self) -> None:
        """The service began to stop: a task that returns from now on finished its work (e.g. a
        pool drained by its own stop), it did not die. `stop` implies it."""
        self._stopping = True

    def _done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None and self._stopping:
            return
        log.critical("background task %s died: %r", task.get_name(), exc)
        self.failed.set()

    async def stop(self) -> None:
        """Cancel every task and wait for them; raise the error a task died of, if one did."""
        self._stopping = True
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
