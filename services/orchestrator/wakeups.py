"""Claims waiting for work, woken one per run that became claimable, oldest first.

Waking every waiting claim for each queued run made all of them look (a transaction each) and
all but one find nothing: each worker process with a free slot keeps one claim waiting, so a
fleet of N idle workers paid N transactions per run, N - 1 of them for nothing. A claim takes
its ticket before it looks, so a wake-up that arrives during the look is not lost; a wake-up
its holder did not use (it claimed another run, gave up, or went away) is passed on to the
next in line. A wake-up names its run when it is known ("" when not), so a claim that took
that very run passes nothing on. `generation` counts wake-ups: a new claim need not look
while nothing woke since a look that found nothing began. For a wake-up lost on the way
(Redis flushed or down) one poll per replica looks on the waiting claims' behalf
(`Execution.poll_claimable`), not each claim.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Sequence


class Wakeups:
    """A FIFO of waiting claims' tickets."""

    def __init__(self) -> None:
        self._waiting: collections.deque[asyncio.Future[str]] = collections.deque()
        self.generation = 0
        # Whether wake-ups are heard through Redis now (the hint listener is subscribed).
        self.hinted = False

    def ticket(self) -> asyncio.Future[str]:
        """Join the line; the ticket completes (with the run's id, or "") when a run may be
        there for its holder."""
        ticket: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._waiting.append(ticket)
        return ticket

    @property
    def waiting(self) -> int:
        """Claims waiting in line now."""
        return sum(1 for ticket in self._waiting if not ticket.done())

    def wake(self, run_ids: Sequence[str] = ("",)) -> None:
        """One claim per run that may have become claimable, the longest-waiting first."""
        self.generation += 1
        pending = list(run_ids)
        while pending and self._waiting:
            ticket = self._waiting.popleft()
            if not ticket.done():
                ticket.set_result(pending.pop(0))

    def wake_all(self) -> None:
        """Wake every waiting claim (wake-ups may have been lost)."""
        self.wake([""] * max(len(self._waiting), 1))

    def hints_lost(self) -> None:
        """Wake-ups are no longer heard through Redis: wake every claim, and poll often."""
        self.hinted = False
        self.wake_all()

    def hints_heard(self) -> None:
        """Wake-ups are heard again: wake every claim, for those published while away."""
        self.hinted = True
        self.wake_all()

    def leave(
        self, ticket: asyncio.Future[str], *, claimed: str | None, looking_again: bool = False
    ) -> None:
        """Leave the line, having `claimed` that run (or none). A wake-up the ticket received
        for another run goes to the next claim in line, unless its holder looks again."""
        if not ticket.done() or ticket.cancelled():
            ticket.cancel()
            with contextlib.suppress(ValueError):
                self._waiting.remove(ticket)
            return
        woken_for = ticket.result()  # a woken ticket has left the line already
        if not looking_again and not (woken_for and woken_for == claimed):
            self.wake([woken_for])
