"""The orchestrator's Redis wake-up listener (the reaper and the retry scheduler are periodic
rounds of `Execution`, run by `tether.runtime.every`)."""

from __future__ import annotations

from typing import Any

from services.orchestrator.execution import Execution
from tether.bus import Bus
from tether.hints import WAKE_CHANNEL, decode_wake
from tether.runtime import listen_forever


async def listen_for_wakeups(bus: Bus, execution: Execution) -> None:
    """Wake waiting claims when admission or another replica queues a run."""

    def heard(message: dict[str, Any]) -> None:
        run_id, origin = decode_wake(message.get("data") or "")
        if origin != execution.wake_marker:  # this replica woke its own already
            execution.wakeups.wake([run_id])

    # Claims fall back to polling while Redis is away: nothing is lost, only slower.
    await listen_forever(
        bus,
        "wake-up listener",
        lambda pubsub: pubsub.subscribe(WAKE_CHANNEL),
        heard,
        on_lost=execution.wakeups.wake_all,
    )
