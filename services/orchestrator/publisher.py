"""Publishing from the orchestrator: committed events to the runs' live channels, and wake-ups
for claims waiting here and on every other replica. Events are posted only after their
transaction commits; every message is a hint (see `tether.bus`)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Collection, Sequence
from datetime import UTC, datetime
from typing import Protocol

from services.orchestrator import observed
from services.orchestrator.repositories.transitions import Moved
from services.orchestrator.wakeups import Wakeups
from tether import telemetry
from tether.bus import Bus
from tether.domain import StoredEvent
from tether.hints import Audience, LiveMessage, encode_events, events_channel
from tether.states import RunStatus


class Addressed(Protocol):
    """What publishing needs of a run: where its events go and who may see them (a run as
    read or moved, or what a checkpoint's fence returned of it)."""

    @property
    def run_id(self) -> str: ...
    @property
    def tenant_id(self) -> str: ...
    @property
    def owner_principal_id(self) -> str | None: ...


class Publisher:
    """Posts a replica's committed events and wakes claims."""

    def __init__(self, bus: Bus | None) -> None:
        self._bus = bus
        # Waiting claims, woken one per run that may have become claimable.
        self.wakeups = Wakeups()
        # Marks this replica's own wake-up messages, which come back to it through Redis.
        self.wake_marker = f"orchestrator-{uuid.uuid4().hex}"
        # The tenants with a cap, as this replica last read them (`caps.CapWatch`).
        self.capped: Callable[[], Collection[str]] = frozenset
        # Set when a child run ends here, or a parent parks on its children here: the parents
        # named in `parents_to_look` may have no active child left (`children`).
        self.child_ended = asyncio.Event()
        self.parents_to_look: set[str] = set()

    async def publish(
        self, run: Addressed, events: Sequence[StoredEvent], *, delivered: bool = False
    ) -> None:
        """Post committed events of `run`; with
        `delivered`, return once they reached Redis."""
        if self._bus is None or not events:
            return
        now = datetime.now(UTC).isoformat()
        audience = Audience(run.tenant_id, run.owner_principal_id or "")
        messages = [
            LiveMessage(run.run_id, s.seq, s.event.type, s.event.payload, now, audience=audience)
            for s in events
        ]
        self._bus.post(events_channel(run.run_id), encode_events(messages))
        if delivered:
            await self._bus.delivered()

    def wake(self, run_ids: Sequence[str] = ("",)) -> None:
        """These runs ("" for one not known by id) may have become claimable: wake a claim
        for each here and, through Redis, on every other replica."""
        self.wakeups.wake(run_ids)
        if self._bus is not None:
            for run_id in run_ids:
                self._bus.notify_queued(run_id, self.wake_marker)

    def look_at_parent(self, run_id: str) -> None:
        """The run may be waiting for children none of which is active any more: the children
        waker looks at it now."""
        self.parents_to_look.add(run_id)
        self.child_ended.set()

    def wake_next(self, moved: Moved) -> None:
        """A move that lets go of its session (an ending, a park) handed it to the next
        message: that run may now run. Every such move passes here, so it is counted here."""
        if telemetry.on:
            observed.moved(moved.run)
        if moved.run.tree_parent_run_id is not None and RunStatus(moved.run.status).terminal:
            self.look_at_parent(moved.run.tree_parent_run_id)
        if moved.handed_over is not None:
            self.wake([moved.handed_over])
        elif moved.run.tenant_id in self.capped():
            # A run of a capped tenant ended: one of its queued runs may lease now.
            self.wake()
