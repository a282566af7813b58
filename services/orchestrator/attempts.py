"""What a worker writes under its lease (heartbeat, checkpoint, tool output, effects) and how an
attempt hands its run back: completed, failed or cancelled, or released for another worker.

Every write is fenced by the lease epoch; a stale epoch is StaleLease (FAILED_PRECONDITION) and
the worker abandons the attempt. Events are published only after their transaction commits.
Checkpoints and completions go through the replica's group committer: those that arrive
together share a transaction, one that arrives alone is one statement. A completion is one
statement (`repositories.completion`); failing or cancelling, rarer, take a few.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.orchestrator.cancellation import cancel_instead
from services.orchestrator.prices import Prices
from services.orchestrator.publisher import Publisher
from services.orchestrator.repositories import completion, history, progress
from services.orchestrator.repositories import leases as lease_repo
from services.orchestrator.repositories import parts as parts_repo
from services.orchestrator.repositories.completion import (
    ending_error,
    ending_values,
    ending_warnings,
)
from services.orchestrator.repositories.transitions import NOW, Moved, apply
from tether import formats, states
from tether.db.committer import Committer, Prepared
from tether.domain import (
    Batch,
    Cancelled,
    Completed,
    Completion,
    Ending,
    Event,
    Failed,
    Interruption,
    Part,
    Run,
    StoredEvent,
    Summary,
    close_attempt,
    run_cancelled,
    run_completed,
    run_failed,
    run_queued,
)
from tether.errors import InvalidArgument, StaleLease

_FINISH = {
    Completed: states.COMPLETE,
    Failed: states.FAIL,
    Cancelled: states.CANCEL_BY_WORKER,
}
# What an ending that is not a completion does to the calls the worker left open.
# (A completion's are closed by the worker, which alone knows whether a limit stopped it.)
_INTERRUPTED = {Failed: Interruption.RUN_FAILED, Cancelled: Interruption.RUN_CANCELLED}


def _stale(run_id: str, epoch: int) -> StaleLease:
    return StaleLease(f"lease epoch {epoch} of run {run_id} is no longer current")


class Attempts:
    """The lease's writes and its ends, on this replica."""

    def __init__(
        self,
        engine: AsyncEngine,
        publisher: Publisher,
        prices: Prices,
        *,
        lease_ttl_s: float,
        writers: int = 4,  # transactions the group committer keeps open at once (Committer)
        stored_format: int = formats.NEWEST,  # the newest its events are stored in
    ) -> None:
        self._engine = engine
        self._stored_format = stored_format
        self._publisher = publisher
        self._prices = prices
        self._ttl = lease_ttl_s
        self._committer = Committer(engine, writers=writers)

    @property
    def committer(self) -> Committer:
        """The group committer checkpoints and completions are written through."""
        return self._committer

    async def heartbeat(self, run_id: str, epoch: int) -> progress.Held:
        """Extend the lease (its expiry and the cancel request); StaleLease when it is gone."""
        async with self._engine.begin() as conn:
            row = await progress.hold_lease(conn, run_id, epoch, self._ttl)
        if row is None:
            raise _stale(run_id, epoch)
        return row

    async def checkpoint(
        self,
        run_id: str,
        epoch: int,
        batch: Batch,
    ) -> progress.Checkpointed:
        """Persist parts, events and priced turns under the lease, in one statement (with the
        writes that arrive with it, in one transaction)."""

        async def prepare(
            conn: AsyncConnection,
        ) -> Prepared[tuple[progress.Checkpointed, list[StoredEvent]] | None]:
            params = await self._batch_params(conn, run_id, epoch, batch)
            return Prepared(params, lambda row: progress.checkpointed(row, batch.events))

        written = await self._committer.write_statement(
            run_id, progress.CHECKPOINT, prepare, matched_by="run_id"
        )
        if written is None:
            # A numbered batch that landed already came with the completion, which ended the
            # lease: from here both cases are the same refusal.
            raise _stale(run_id, epoch)
        row, events = written
        # The worker's next live deltas go out when this returns: they must not overtake these.
        await self._publisher.publish(row, events, delivered=True)
        return row

    async def store_summary(
        self, run_id: str, epoch: int, part: Part, events: Sequence[Event]
    ) -> progress.Checkpointed:
        """Store a compaction summary (a part of the run, with its events) under the lease and
        name it its session's summary of the runs it covers, in one transaction: once per range
        (FailedPrecondition for a second one, nothing stored)."""
        if not isinstance(part.content, Summary) or not part.final:
            raise InvalidArgument("a stored summary is a final summary part")
        async with self._engine.begin() as conn:
            written = await progress.checkpoint(conn, run_id, epoch, self._ttl, [part], events, [])
            if written is None:
                raise _stale(run_id, epoch)
            await history.record_summary(conn, run_id, part)
        row, stored = written
        await self._publisher.publish(row, stored, delivered=True)
        return row

    async def write_batch(
        self, conn: AsyncConnection, run_id: str, epoch: int, batch: Batch
    ) -> tuple[progress.Checkpointed, list[StoredEvent]] | None:
        """Write a checkpoint's batch under the lease on `conn` (its turns priced): the fence's
        row and the events appended, or None when the lease is stale (or a numbered batch
        landed already)."""
        params = await self._batch_params(conn, run_id, epoch, batch)
        return progress.checkpointed(await progress.CHECKPOINT.first(conn, params), batch.events)

    async def _batch_params(
        self, conn: AsyncConnection, run_id: str, epoch: int, batch: Batch
    ) -> dict[str, Any]:
        priced = await self._prices.priced(conn, run_id, batch.turns)
        return progress.checkpoint_params(
            run_id,
            epoch,
            self._ttl,
            batch.parts,
            batch.events,
            priced,
            batch=batch.number,
            stored_format=self._stored_format,
        )

    async def store_tool_output(self, run_id: str, epoch: int, ref: str, content: str) -> None:
        """Keep a whole tool output under the lease."""
        async with self._engine.begin() as conn:
            if await progress.hold_lease(conn, run_id, epoch, self._ttl) is None:
                raise _stale(run_id, epoch)
            await progress.store_tool_output(conn, run_id, ref, content)

    async def begin_effect(
        self, run_id: str, epoch: int, key: str, tool_name: str
    ) -> tuple[str, dict[str, Any] | None]:
        """Open (or find) the effects record of a side effect, under the lease."""
        async with self._engine.begin() as conn:
            held = await progress.hold_lease(conn, run_id, epoch, self._ttl)
            if held is None:
                raise _stale(run_id, epoch)
            return await progress.begin_effect(conn, held.tenant_id, key, run_id, epoch, tool_name)

    async def finish_effect(
        self, run_id: str, epoch: int, key: str, result: dict[str, Any]
    ) -> None:
        """Store an effect's result, under the lease."""
        async with self._engine.begin() as conn:
            held = await progress.hold_lease(conn, run_id, epoch, self._ttl)
            if held is None:
                raise _stale(run_id, epoch)
            await progress.finish_effect(conn, held.tenant_id, key, result)

    async def complete(self, run_id: str, epoch: int, done: Completion) -> Run:
        """The completion transaction: final state, usage per turn, audit, stage durations.

        A cancel accepted before it landed wins: the run ends cancelled instead (the worker's
        parts kept), whatever outcome the worker reported."""
        if isinstance(done.ending, Completed):
            completed = await self._complete(run_id, epoch, done, done.ending)
            if completed is not None:
                return completed
            # A cancel was accepted first and nothing was written: the run ends cancelled, as
            # any other ending would, below.
        return await self._end(run_id, epoch, done)

    async def _complete(
        self, run_id: str, epoch: int, done: Completion, ending: Completed
    ) -> Run | None:
        """A completed run's ending in one statement; None when a cancel came first."""
        # The attempt's stage durations are on its attempts row; the audit says what ended how.
        audit = {**done.audit, "warnings": list(ending.warnings)}
        in_flight = done.in_flight or Batch(0)

        async def prepare(conn: AsyncConnection) -> Prepared[completion.Ended | None]:
            priced = await self._prices.priced(conn, run_id, in_flight.turns)
            flight = replace(in_flight, turns=priced)
            params = completion.complete_params(
                run_id,
                epoch,
                ending,
                in_flight=flight,
                parts=done.parts,
                events=done.events,
                turns=await self._prices.priced(conn, run_id, done.turns),
                stages=_worker_stages(done),
                audit=audit,  # the usage is added by the statement, which totals it
                stored_format=self._stored_format,
            )
            return Prepared(params, lambda row: completion.ended(row, ending, done.events, flight))

        ended = await self._committer.write_statement(
            run_id, completion.COMPLETE, prepare, matched_by=completion.FENCED
        )
        if ended is None:
            raise _stale(run_id, epoch)
        if ended.moved is None:
            return None
        self._prices.forget(run_id)
        # One commit's events, the in-flight batch's and the ending's: one message.
        await self._publisher.publish(ended.moved.run, [*ended.landed, *ended.moved.events])
        self._publisher.wake_next(ended.moved)  # the session's next message may now run
        return ended.moved.run

    async def _end(self, run_id: str, epoch: int, done: Completion) -> Run:
        """An ending in a transaction of a few statements: a failure or a cancel (the calls
        left open closed as interrupted), or a completion a cancel came before."""
        ending = done.ending
        transition = _FINISH[type(ending)]
        worker_stages = _worker_stages(done)
        async with self._engine.begin() as conn:
            landed = None
            if done.in_flight is not None:
                # The checkpoint the worker sent but had no answer for, unless it landed already
                # (a stale lease writes nothing here, and the fenced write below refuses it).
                landed = await self.write_batch(conn, run_id, epoch, done.in_flight)
            parts = list(done.parts)
            closing_events: list[Event] = []
            superseded: list[Part] = []
            interrupted = _INTERRUPTED.get(type(ending))
            if interrupted is not None:
                # Whatever the worker could not finish is closed as interrupted (and a call cut
                # mid-stream superseded), so the history stays well-formed for the model and
                # for people.
                attempt, known = await parts_repo.attempt_and_parts(conn, run_id)
                merged = {p.index: p for p in [*known, *parts]}
                closing = close_attempt(
                    [merged[i] for i in sorted(merged)],
                    attempt,
                    regenerated=False,
                    interrupted=interrupted,
                )
                parts = [*parts, *closing.parts]
                closing_events, superseded = closing.events, closing.superseded
            # Parts and turns in one fenced statement: a stale lease writes nothing, here.
            written = await self.write_batch(conn, run_id, epoch, Batch(0, parts, (), done.turns))
            if written is None:
                raise _stale(run_id, epoch)
            await parts_repo.supersede(conn, run_id, superseded)
            usage = await progress.usage_total(conn, run_id)
            before = [*done.events, *closing_events]
            moved = await apply(
                conn,
                transition,
                run_id,
                epoch=epoch,
                events=[*before, _terminal_event(ending, usage)],
                values={
                    **lease_repo.lease_cleared(),
                    **ending_values(ending),
                    "finished_at": NOW,
                    "usage": usage,
                },
            )
            if moved is None and transition.yields_to_cancel:
                # Refused: a cancel was accepted before this outcome (or the lease is gone,
                # and the same fence refuses this too).
                moved = await cancel_instead(conn, run_id, epoch, before=before)
                if moved is None:
                    raise _stale(run_id, epoch)
            elif moved is None:
                raise _stale(run_id, epoch)
            else:
                await lease_repo.end_attempt(
                    conn,
                    run_id,
                    epoch,
                    transition.target.value,
                    error=ending_error(ending),
                    stages=worker_stages,
                    detail={
                        **done.audit,
                        "usage": usage,
                        "warnings": list(ending_warnings(ending)),
                    },
                )
        self._prices.forget(run_id)
        flight = [] if landed is None else landed[1]
        await self._publisher.publish(moved.run, [*flight, *moved.events])  # one commit's
        self._publisher.wake_next(moved)  # the session's next message may now run
        return moved.run

    async def release(self, run_id: str, epoch: int) -> bool:
        """Give the lease back without spending an attempt (graceful worker shutdown); a run
        whose cancel was accepted ends cancelled instead of going back to the queue."""
        async with self._engine.begin() as conn:
            # The worker closed its calls before releasing; the next one streams a cut turn anew.
            attempt, parts = await parts_repo.attempt_and_parts(conn, run_id)
            closing = close_attempt(parts, attempt, regenerated=True, interrupted=None)
            moved: Moved | None = await apply(
                conn,
                states.RELEASE,
                run_id,
                epoch=epoch,
                events=[*closing.events, run_queued(0, "released")],
                values=lease_repo.lease_cleared(),
            )
            if moved is not None:
                await parts_repo.write_closing(conn, run_id, epoch, closing)
                await lease_repo.end_attempt(conn, run_id, epoch, "released")
                woken = [run_id]
            else:
                moved = await cancel_instead(conn, run_id, epoch)
                if moved is None:
                    return False
                woken = [moved.handed_over] if moved.handed_over else []
        await self._publisher.publish(moved.run, moved.events)
        if woken:
            self._publisher.wake(woken)
        return True


def _terminal_event(ending: Ending, usage: dict[str, int]) -> Event:
    if isinstance(ending, Completed):
        return run_completed(ending, usage)
    if isinstance(ending, Failed):
        return run_failed(ending.error)
    return run_cancelled(ending.reason)


def _worker_stages(done: Completion) -> dict[str, float]:
    # Routing happened here at claim time and is already on the attempt row.
    return {k: v for k, v in done.stages.items() if k != "routing_ms"}
