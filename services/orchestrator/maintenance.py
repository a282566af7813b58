"""The orchestrator's Redis wake-up listener: claims waiting on this replica wake when admission
or another replica queues a run."""

from __future__ import annotations

from services.orchestrator.publisher import Publisher
from tether.bus import Bus
from tether.hints import WAKE_CHANNEL, decode_wake
from tether.runtime.subscription import Published, Subscription


async def listen_for_wakeups(bus: Bus, publisher: Publisher) -> None:
    """Wake waiting claims when admission or another replica queues a run."""

    def heard(message: Published) -> None:
        run_id, origin = decode_wake(message.data)
        if origin != publisher.wake_marker:  # this replica woke its own already
            publisher.wakeups.wake([run_id])

    # Claims fall back to polling while Redis is away: nothing is lost, only slower. Every
    # waiting claim looks once when the listener is lost and again when it is back, for the
    # wake-ups published while it was away.
    wake_all = publisher.wakeups.wake_all
    listener = Subscription(
        bus.url, "wake-listener", heard, channels=[WAKE_CHANNEL], on_lost=wake_all, on_live=wake_all
    )
    await listener.run()
