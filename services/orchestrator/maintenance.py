"""The orchestrator's Redis hints: wake-ups (a run may have become claimable: admission or another
replica queued it) wake the claims and the lease dispatcher here; cancel hints (a caller asked
to cancel a run) make the Work stream holding the run, if it is here, ask PostgreSQL and push
the cancel. Hints only: nothing is lost while Redis is away, only slower."""

from __future__ import annotations

import asyncio
import logging

from services.orchestrator.publisher import Publisher
from services.orchestrator.work import Work
from tether.bus import Bus
from tether.hints import CANCEL_PATTERN, WAKE_CHANNEL, CancelHint, decode_cancel, decode_wake
from tether.runtime.subscription import Published, Subscription

log = logging.getLogger(__name__)


async def listen_for_hints(bus: Bus, publisher: Publisher, work: Work) -> None:
    """Wake claims for queued runs, and push the cancels this replica's streams must carry."""
    checks: set[asyncio.Task[None]] = set()

    def heard(message: Published) -> None:
        try:
            hint = (
                decode_cancel(message.channel, message.data)
                if message.pattern
                else decode_wake(message.data)
            )
        except ValueError as exc:
            # Only a hint: the poll and the keepalives make up for it.
            log.warning("ignoring a hint on %s: %s", message.channel, exc)
            return
        if isinstance(hint, CancelHint):
            check = asyncio.ensure_future(work.cancel_hinted(hint.run_id))
            checks.add(check)
            check.add_done_callback(checks.discard)
        elif hint.origin != publisher.wake_marker:  # this replica woke its own already
            publisher.wakeups.wake([hint.run_id])

    # Claims fall back to polling while Redis is away, and keepalives carry every cancel: every
    # waiting claim looks once when the listener is lost and again when it is back, for the
    # wake-ups published while it was away.
    wakeups = publisher.wakeups
    listener = Subscription(
        bus.url,
        "hint-listener",
        heard,
        channels=[WAKE_CHANNEL],
        patterns=[CANCEL_PATTERN],
        on_lost=wakeups.hints_lost,
        on_live=wakeups.hints_heard,
    )
    await listener.run()
