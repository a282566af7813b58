"""Redis as a carrier of hints: wake-ups, live fan-out and cancel hints.

Nothing here is a source of truth. Every message can be lost (Redis flushed, restarted, a
subscriber slow) and the system still converges from PostgreSQL; so a Redis failure is logged
and swallowed on the publishing side, never allowed to fail a committed transaction's caller.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from tether.hints import WAKE_CHANNEL, encode_wake

log = logging.getLogger(__name__)

# Hints waiting to be sent; past this the oldest are dropped (subscribers re-read PostgreSQL).
MAX_PENDING = 100_000
# How long `delivered` waits for Redis before giving up (a hint is never worth a stall).
DELIVERY_WAIT_S = 1.0
# How long one batch may take to go out before its connection is dropped and the batch given
# up on (a Redis that stalls without closing the socket).
SEND_TIMEOUT_S = 2.0


class Bus:
    """Best-effort publishing of hints over Redis.

    `post` never waits: messages go to one background sender that pipelines whatever has
    accumulated, in order, so a hot path (a checkpoint, a token delta) pays no Redis round trip.
    """

    def __init__(self, url: str) -> None:
        self.url = url  # for a subscriber beside this publisher (`tether.runtime.subscription`)
        # No socket timeout: redis-py spends a task on every write it bounds; a batch is bounded
        # as a whole instead (SEND_TIMEOUT_S), and a cancelled command drops its connection.
        # A batch that meets a connection Redis closed (Redis restarted since its last use) is
        # sent once more on a new connection, at once: without it, the first hints after every
        # restart were lost. `from_url` gives its connections no retry of their own. Once, as
        # a Redis that is down fails the second try too; a connect timeout is not retried (the
        # batch's bound would run out first).
        self.client: redis.Redis = redis.Redis.from_url(
            url,
            socket_connect_timeout=1.0,
            health_check_interval=10,
            retry=Retry(NoBackoff(), retries=1, supported_errors=(RedisConnectionError,)),
        )
        self._pending: collections.deque[tuple[str, bytes | str]] = collections.deque(
            maxlen=MAX_PENDING
        )
        self._ready = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._sender: asyncio.Task[None] | None = None
        self._posted = 0  # messages ever queued
        self._settled = 0  # of those, how many were sent or given up on
        self._last_lost = 0  # the settled count just after the latest message given up on
        self._reported = 0  # the settled count up to which `delivered` has answered
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    def post(self, channel: str, message: bytes | str) -> None:
        """Queue a message for the background sender (in order, never blocking)."""
        if len(self._pending) == self._pending.maxlen:
            self._settled += 1  # the oldest falls off the full queue, unsent
            self._last_lost = self._settled
        self._pending.append((channel, message))
        self._posted += 1
        self._idle.clear()
        self._ready.set()
        if self._sender is None or self._sender.done():
            self._sender = asyncio.get_running_loop().create_task(self._send(), name="bus-sender")

    async def _send(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._pending:
                batch = [self._pending.popleft() for _ in range(min(len(self._pending), 512))]
                try:
                    pipe = self.client.pipeline(transaction=False)
                    for channel, message in batch:
                        pipe.publish(channel, message)
                    async with asyncio.timeout(SEND_TIMEOUT_S):
                        await pipe.execute()
                    self._settled += len(batch)
                except (RedisError, OSError) as exc:
                    log.warning("redis publish of %d hint(s) failed: %s", len(batch), exc)
                    self._settled += len(batch)
                    self._last_lost = self._settled
                self._wake_waiters()
            self._idle.set()

    def _wake_waiters(self) -> None:
        waiting = []
        for target, future in self._waiters:
            if self._settled >= target:
                if not future.done():
                    future.set_result(None)
            else:
                waiting.append((target, future))
        self._waiters = waiting

    async def delivered(self) -> bool:
        """Wait until what was posted so far has gone to Redis or been given up on, at most
        DELIVERY_WAIT_S: for a caller whose next step must not overtake these messages.

        True when Redis took every message posted since the previous answer; False when one
        was given up on (Redis unreachable, the queue full) or the wait ran out. A caller may
        go on either way: hints are best effort, and subscribers re-read PostgreSQL."""
        target = self._posted
        if self._settled < target:
            future = asyncio.get_running_loop().create_future()
            self._waiters.append((target, future))
            try:
                await asyncio.wait_for(future, DELIVERY_WAIT_S)
            except TimeoutError:
                return False
        reported, self._reported = self._reported, max(self._reported, target)
        return self._last_lost <= reported

    async def flush(self) -> None:
        """Send everything queued so far (used before closing)."""
        if self._sender is not None and not self._sender.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), 5.0)

    def notify_queued(self, run_id: str, origin: str = "") -> None:
        """Wake an idle worker: a run became claimable (`origin`: the replica that woke its own
        waiting claims already)."""
        self.post(WAKE_CHANNEL, encode_wake(run_id, origin))

    async def close(self) -> None:
        """Send what is queued, then close the connection pool."""
        await self.flush()
        if self._sender is not None:
            self._sender.cancel()
        await self.client.aclose()
