"""Redis as a carrier of hints: wake-ups, live fan-out and cancel signals.

Nothing here is a source of truth. Every message can be lost (Redis flushed, restarted, a
subscriber slow) and the system still converges from PostgreSQL; so a Redis failure is logged
and swallowed on the publishing side, never allowed to fail a committed transaction's caller.
"""

from __future__ import annotations

import logging

import redis.asyncio as redis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

WAKE_CHANNEL = "tether:wake"


def cancel_channel(run_id: str) -> str:
    """Channel a run's cancel signal is published on."""
    return f"tether:cancel:{run_id}"


def events_channel(run_id: str) -> str:
    """Channel a run's committed events and live deltas are published on."""
    return f"tether:events:{run_id}"


class Bus:
    """Best-effort publishing of hints over Redis."""

    def __init__(self, url: str) -> None:
        self.client: redis.Redis = redis.Redis.from_url(
            url, socket_connect_timeout=1.0, socket_timeout=2.0, health_check_interval=10
        )

    async def publish(self, channel: str, message: bytes | str) -> None:
        """Publish, logging (not raising) when Redis is unavailable."""
        try:
            await self.client.publish(channel, message)
        except (RedisError, OSError) as exc:
            log.warning("redis publish to %s failed: %s", channel, exc)

    async def notify_queued(self, run_id: str) -> None:
        """Wake an idle worker: a run became claimable."""
        await self.publish(WAKE_CHANNEL, run_id)

    async def close(self) -> None:
        """Close the connection pool."""
        await self.client.aclose()
