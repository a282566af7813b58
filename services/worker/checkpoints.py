"""The attempt's checkpoint writer: progress written behind the loop, live deltas coalesced.

Write-behind: a checkpoint is sent by one background writer per attempt while the attempt
streams and runs tools, so a turn never waits on the database; one writer keeps them in order,
and what piles up while one is in flight goes in the next. The barrier is `sync()` (before
parking, a retry, a release, and an external side effect: nothing fires before its call is
durable). The completion does not wait: `seal` hands it whatever is left and the checkpoint
still in flight (numbered, so it lands once whichever comes first).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.worker import observed
from services.worker.orchestrator_client import Orchestrator
from services.worker.transcript import Transcript
from tether import telemetry
from tether.bus import Bus
from tether.domain import Batch, Lease, text_delta
from tether.hints import LiveMessage, encode_events, events_channel


@dataclass(frozen=True, slots=True)
class Handover:
    """What the completion carries for the writer: the progress never sent (`rest`, batch 0)
    and the numbered checkpoint still in flight, if one is."""

    rest: Batch
    in_flight: Batch | None


class CheckpointWriter:
    """Writes one attempt's progress under its lease, one checkpoint at a time.

    `stop_attempt` is called with the error when a write fails (fenced out, the orchestrator
    gone, or a bug): the attempt stops where it is. `cancel_requested` is called when a
    checkpoint's answer carries the caller's durable cancel request.
    """

    def __init__(
        self,
        *,
        orchestrator: Orchestrator,
        transcript: Transcript,
        lease: Lease,
        bus: Bus | None,
        stop_attempt: Callable[[Exception], None],
        cancel_requested: Callable[[], None],
    ) -> None:
        self._orchestrator = orchestrator
        self._transcript = transcript
        self._lease = lease
        self._run_id = lease.run_id
        self._bus = bus
        self._stop_attempt = stop_attempt
        self._cancel_requested = cancel_requested
        self._writer: asyncio.Task[None] | None = None
        self._batches = 0  # checkpoints sent under this lease
        self._in_flight: Batch | None = None
        self._write_wanted = False
        self._whole_wanted = False  # the next checkpoint carries even what could wait
        self.error: Exception | None = None
        """What stopped writing under this lease; `sync` and `seal` raise it."""
        self.sealed = False
        """The completion carries the rest: nothing more is written from here."""
        self._held_deltas: list[tuple[int, str, int]] = []  # (part index, text, offset)
        self._deltas_due = False

    def checkpoint(self) -> None:
        """Send what changed since the last checkpoint, behind the attempt's back."""
        self._write_wanted = True
        if self._writer_idle():
            self._writer = asyncio.create_task(self._write(), name=f"checkpoint-{self._run_id}")

    async def _write(self) -> None:
        while self._write_wanted and self.error is None and not self.sealed:
            self._write_wanted = False
            whole, self._whole_wanted = self._whole_wanted, False
            if not (self._transcript.pending if whole else self._transcript.due):
                continue
            self._batches += 1
            self._in_flight = self._transcript.take(self._batches, whole=whole)
            try:
                writing = self._orchestrator.checkpoint(self._lease, self._in_flight)
                if telemetry.on:
                    writing = observed.checkpoint(self._in_flight, writing)
                cancel_requested = await writing
            except Exception as exc:
                if self.sealed:
                    return  # the completion carried this batch; its answer decides
                self._stop_attempt(exc)
                return
            finally:
                self._in_flight = None
            self._transcript.progressed_at = time.monotonic()
            if cancel_requested:
                self._cancel_requested()
        self._release_deltas()  # idle: every event recorded before them has landed

    def stop(self, error: Exception) -> None:
        """Write nothing more under this lease; `sync` raises `error` (the first one wins)."""
        if self.error is None:
            self.error = error

    def _writer_idle(self) -> bool:
        return self._writer is None or self._writer.done()

    async def sync(self) -> None:
        """Checkpoint everything that changed (a streaming part's snapshot that could wait
        too) and wait until every requested checkpoint has landed; raise what stopped the
        writer."""
        if self._transcript.pending:
            self._whole_wanted = True
            self.checkpoint()
        if self._writer is not None:
            await asyncio.shield(self._writer)
        if self.error is not None:
            raise self.error

    async def carry(self) -> Batch | None:
        """Everything that changed as the next numbered checkpoint, once the one in flight has
        landed, for a request that writes it in its own transaction (a delegate call's
        StartChild) instead of a round trip of its own; None when nothing changed. Raise what
        stopped the writer. Unlike `sync`, nothing is written here: if that request fails,
        the attempt is over (its lease lost, or its orchestrator gone)."""
        if self._writer is not None:
            await asyncio.shield(self._writer)
        if self.error is not None:
            raise self.error
        if not self._transcript.pending:
            return None
        self._batches += 1
        return self._transcript.take(self._batches, whole=True)

    def seal(self) -> Handover:
        """Hand the completion everything not yet written (the checkpoint in flight too); from
        here the writer sends nothing more. Raise what stopped the writer."""
        if self.error is not None:
            raise self.error
        # One round trip carries the rest, and the checkpoint still in flight rides along
        # instead of being waited for.
        self.sealed = True
        in_flight = self._in_flight
        if self._writer_idle():
            self._release_deltas()
        else:
            # Held behind the checkpoint in flight, they could only go out after the terminal
            # event now; their parts go whole with the completion instead.
            self._held_deltas.clear()
        return Handover(self._transcript.take(0, whole=True), in_flight)

    async def publish_delta(self, part_index: int, text: str, offset: int) -> None:
        """Live token delta for subscribers (ephemeral, seq 0). Deltas are posted once the
        loop comes round (what arrived in one read goes out as one message), and while a
        checkpoint is in flight they wait for it: a delta never overtakes an event recorded
        before it."""
        if self._bus is None:
            return
        held = self._held_deltas
        if held and held[-1][0] == part_index and held[-1][2] + len(held[-1][1]) == offset:
            held[-1] = (part_index, held[-1][1] + text, held[-1][2])
        else:
            held.append((part_index, text, offset))
        if not self._deltas_due:
            self._deltas_due = True
            asyncio.get_running_loop().call_soon(self._post_deltas)

    def _post_deltas(self) -> None:
        self._deltas_due = False
        if self._writer_idle():
            self._release_deltas()
        # else the writer posts them when it goes idle

    async def deltas_out(self) -> None:
        """Post the held deltas and wait (bounded) until they reached Redis: the orchestrator
        may answer the next call with part.superseded for their parts, which must not overtake
        them. Only when the writer is idle (after `sync`)."""
        self._release_deltas()
        if self._bus is not None:
            await self._bus.delivered()

    def _release_deltas(self) -> None:
        if self._bus is not None:
            for part_index, text, offset in self._held_deltas:
                self._bus.post(
                    events_channel(self._run_id),
                    _delta_json(self._run_id, part_index, text, offset),
                )
        self._held_deltas.clear()


def _delta_json(run_id: str, part_index: int, text: str, offset: int) -> str:
    delta = text_delta(part_index, text, offset)
    return encode_events([LiveMessage(run_id, 0, delta.type, delta.payload)])
