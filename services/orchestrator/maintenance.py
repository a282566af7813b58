"""The orchestrator's Redis wake-up listener: claims waiting on this replica wake when admission
or another replica queues a run."""

from __future__ import annotations

from typing import Any

from services.orchestrator.publisher import Publisher
from tether.bus import Bus
from tether.hints import WAKE_CHANNEL, decode_wake
from tether.runtime import listen_forever


async def listen_for_wakeups(bus: Bus, publisher: Publisher) -> None:
    """Wake waiting claims when admission or another replica queues a run."""

    def heard(message: dict[str, Any]) -> None:
        run_id, origin = decode_wake(message.get("data") or "")
        if origin != publisher.wake_marker:  # this replica woke its own already
            publisher.wakeups.wake([run_id])

    # Claims fall back to polling while Redis is away: nothing is lost, only slower.
    await listen_forever(
        bus,
        "wake-up listener",
        lambda pubsub: pubsub.subscribe(WAKE_CHANNEL),
        heard,
        on_lost=publisher.wakeups.wake_all,
    )
