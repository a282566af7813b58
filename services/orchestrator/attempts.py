"""What a worker writes under its lease (heartbeat, checkpoint, tool output, effects) and how an
attempt hands its run back: completed, failed or cancelled, or released for another worker.

Every write is fenced by the lease epoch; a stale epoch is StaleLease (FAILED_PRECONDITION) and
the worker abandons the attempt. Events are published only after their transaction commits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.orchestrator.cancellation import cancel_instead
from services.orchestrator.prices import Prices
from services.orchestrator.publisher import Publisher
from services.orchestrator.repositories import leases as lease_repo
from services.orchestrator.repositories import progress as repo
from services.orchestrator.repositories.progress import PartRow
from tether import states
from tether.db.transitions import NOW, Event, apply
from tether.domain import camel_keys
from tether.errors import InvalidArgument, StaleLease
from tether.states import RunStatus


@dataclass(frozen=True)
class Completion:
    """What a worker reports when an attempt ends."""

    status: RunStatus
    result_text: str = ""
    task_outcome: str = ""
    warnings: Sequence[str] = ()
    error: dict[str, Any] | None = None
    parts: Sequence[PartRow] = ()
    turns: Sequence[dict[str, Any]] = ()
    stages: dict[str, float] | None = None
    audit: dict[str, Any] | None = None
    events: Sequence[Event] = ()
    in_flight: Batch | None = None


@dataclass
class Batch:
    """A numbered checkpoint batch of the current lease (see CheckpointRequest.batch)."""

    number: int
    parts: Sequence[PartRow] = ()
    events: Sequence[Event] = ()
    turns: Sequence[dict[str, Any]] = ()


_FINISH = {
    RunStatus.COMPLETED: states.COMPLETE,
    RunStatus.FAILED: states.FAIL,
    RunStatus.CANCELLED: states.CANCEL_BY_WORKER,
}
_TERMINAL_EVENT = {
    RunStatus.COMPLETED: "run.completed",
    RunStatus.FAILED: "run.failed",
    RunStatus.CANCELLED: "run.cancelled",
}


class Attempts:
    """The lease's writes and its ends, on this replica."""

    def __init__(
        self, engine: AsyncEngine, publisher: Publisher, prices: Prices, *, lease_ttl_s: float
    ) -> None:
        self._engine = engine
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._publisher = publisher
        self._prices = prices
        self._ttl = lease_ttl_s

    async def heartbeat(self, run_id: str, epoch: int) -> Row[Any]:
        """Extend the lease; StaleLease when it is gone."""
        async with self._engine.begin() as conn:
            row = await lease_repo.heartbeat(conn, run_id, epoch, self._ttl)
        if row is None:
            raise StaleLease(f"lease epoch {epoch} of run {run_id} is no longer current")
        return row

    async def checkpoint(
        self,
        run_id: str,
        epoch: int,
        parts: Sequence[PartRow],
        events: Sequence[Event],
        turns: Sequence[dict[str, Any]],
        *,
        batch: int = 0,
    ) -> Row[Any]:
        """Persist parts, events and priced turns under the lease, in one transaction."""
        async with self._autocommit.connect() as conn:
            priced = await self._prices.priced(conn, run_id, turns)
            fenced = await repo.checkpoint(
                conn, run_id, epoch, self._ttl, parts, events, priced, batch=batch
            )
        if fenced is None:
            # A numbered batch that landed already came with the completion, which ended the
            # lease: from here both cases are the same refusal.
            raise StaleLease(f"lease epoch {epoch} of run {run_id} is no longer current")
        # The worker's next live deltas go out when this returns: they must not overtake these.
        await self._publisher.publish(
            run_id, fenced.last_seq - len(events) + 1, events, delivered=True
        )
        return fenced

    async def store_tool_output(self, run_id: str, epoch: int, ref: str, content: str) -> None:
        """Keep a whole tool output under the lease."""
        async with self._engine.begin() as conn:
            if await repo.fence(conn, run_id, epoch, 0, self._ttl) is None:
                raise StaleLease(f"lease epoch {epoch} of run {run_id} is no longer current")
            await repo.store_tool_output(conn, run_id, ref, content)

    async def begin_effect(
        self, run_id: str, epoch: int, key: str, tool_name: str
    ) -> tuple[str, dict[str, Any] | None]:
        """Open (or find) the effects record of a side effect, under the lease."""
        async with self._engine.begin() as conn:
            fenced = await repo.fence(conn, run_id, epoch, 0, self._ttl)
            if fenced is None:
                raise StaleLease(f"lease epoch {epoch} of run {run_id} is no longer current")
            return await repo.begin_effect(conn, fenced.tenant_id, key, run_id, epoch, tool_name)

    async def finish_effect(
        self, run_id: str, epoch: int, key: str, result: dict[str, Any]
    ) -> None:
        """Store an effect's result, under the lease."""
        async with self._engine.begin() as conn:
            fenced = await repo.fence(conn, run_id, epoch, 0, self._ttl)
            if fenced is None:
                raise StaleLease(f"lease epoch {epoch} of run {run_id} is no longer current")
            await repo.finish_effect(conn, fenced.tenant_id, key, result)

    async def complete(self, run_id: str, epoch: int, done: Completion) -> Row[Any]:
        """The completion transaction: final state, usage per turn, audit, stage durations.

        A cancel accepted before it landed wins: the run ends cancelled instead (the worker's
        parts kept), whatever outcome the worker reported."""
        transition = _FINISH.get(done.status)
        if transition is None:
            raise InvalidArgument("status must be COMPLETED, FAILED or CANCELLED")
        # Routing happened here at claim time and is already on the attempt row.
        worker_stages = {k: v for k, v in (done.stages or {}).items() if k != "routing_ms"}
        async with self._engine.begin() as conn:
            landed = await self._land_in_flight(conn, run_id, epoch, done.in_flight)
            parts = list(done.parts)
            extra: list[Event] = []
            superseded: list[PartRow] = []
            if done.status is not RunStatus.COMPLETED:
                # Whatever the worker could not finish is closed as interrupted (and a call cut
                # mid-stream superseded), so the history stays well-formed for the model and
                # for people.
                attempt, known = await repo.attempt_and_parts(conn, run_id)
                merged = {p.index: p for p in [*known, *parts]}
                closing = repo.close_attempt(
                    sorted(merged.values(), key=_index),
                    attempt,
                    regenerated=False,
                    interrupted="the run was cancelled"
                    if done.status is RunStatus.CANCELLED
                    else "the run failed",
                )
                parts = sorted({p.index: p for p in [*parts, *closing.parts]}.values(), key=_index)
                extra, superseded = closing.events, closing.superseded
            # Parts and turns in one fenced statement: a stale lease writes nothing, here.
            priced = await self._prices.priced(conn, run_id, done.turns)
            fenced = await repo.checkpoint(conn, run_id, epoch, self._ttl, parts, [], priced)
            if fenced is None:
                raise StaleLease(f"lease epoch {epoch} of run {run_id} is no longer current")
            await repo.supersede(conn, run_id, superseded)
            usage = await repo.usage_total(conn, run_id)
            payload = self._terminal_payload(done, usage)
            events = [*done.events, *extra, Event(_TERMINAL_EVENT[done.status], payload)]
            handed_over: list[str] = []
            row = await apply(
                conn,
                transition,
                run_id,
                epoch=epoch,
                events=events,
                handed_over=handed_over,
                values={
                    **lease_repo.lease_cleared(),
                    "finished_at": NOW,
                    "result_text": done.result_text or None,
                    "task_outcome": done.task_outcome or None,
                    "warnings": list(done.warnings),
                    "error": done.error,
                    "usage": usage,
                },
            )
            if row is None and transition.yields_to_cancel:
                # Refused: a cancel was accepted before this outcome (or the lease is gone,
                # and the same fence refuses this too).
                cancelled = await cancel_instead(
                    conn, run_id, epoch, before=[*done.events, *extra], handed_over=handed_over
                )
                if cancelled is None:
                    raise StaleLease(f"lease epoch {epoch} of run {run_id} is no longer current")
                row, events = cancelled
            elif row is None:
                raise StaleLease(f"lease epoch {epoch} of run {run_id} is no longer current")
            else:
                await lease_repo.end_attempt(
                    conn,
                    run_id,
                    epoch,
                    done.status.value,
                    error=done.error,
                    stages=worker_stages,
                    audit=lease_repo.Audit(
                        row.tenant_id,
                        f"run.{done.status.value}",
                        {
                            **(done.audit or {}),
                            "stages": done.stages or {},
                            "usage": usage,
                            "warnings": list(done.warnings),
                        },
                    ),
                )
        self._prices.forget(run_id)
        if landed is not None and done.in_flight is not None:
            early = done.in_flight.events
            await self._publisher.publish(run_id, landed.last_seq - len(early) + 1, early)
        await self._publisher.publish(run_id, row.last_seq - len(events) + 1, events)
        if handed_over:
            self._publisher.wake(handed_over)  # the session's next message may now run
        return row

    async def _land_in_flight(
        self, conn: AsyncConnection, run_id: str, epoch: int, batch: Batch | None
    ) -> Row[Any] | None:
        """Write the checkpoint the worker sent but had no answer for, unless it landed
        already; the fenced row when this wrote it. A stale lease writes nothing here, and the
        completion's own fenced statement refuses it next."""
        if batch is None:
            return None
        priced = await self._prices.priced(conn, run_id, batch.turns)
        return await repo.checkpoint(
            conn, run_id, epoch, self._ttl, batch.parts, batch.events, priced, batch=batch.number
        )

    @staticmethod
    def _terminal_payload(done: Completion, usage: dict[str, Any]) -> dict[str, Any]:
        if done.status is RunStatus.COMPLETED:
            return {
                "resultText": done.result_text,
                "taskOutcome": done.task_outcome,
                "warnings": list(done.warnings),
                "usage": {k: v for k, v in camel_keys(usage).items() if v},
            }
        if done.status is RunStatus.FAILED:
            return {"error": camel_keys(done.error or {})}
        return {"reason": (done.error or {}).get("message", "cancelled")}

    async def release(self, run_id: str, epoch: int) -> bool:
        """Give the lease back without spending an attempt (graceful worker shutdown); a run
        whose cancel was accepted ends cancelled instead of going back to the queue."""
        handed_over: list[str] = []
        async with self._engine.begin() as conn:
            # The worker closed its calls before releasing; the next one streams a cut turn anew.
            attempt, parts = await repo.attempt_and_parts(conn, run_id)
            closing = repo.close_attempt(parts, attempt, regenerated=True, interrupted=None)
            queued = [*closing.events, Event("run.queued", {"reason": "released"})]
            row = await apply(
                conn,
                states.RELEASE,
                run_id,
                epoch=epoch,
                events=queued,
                values=lease_repo.lease_cleared(),
            )
            if row is not None:
                await repo.write_closing(conn, run_id, epoch, closing)
                await lease_repo.end_attempt(conn, run_id, epoch, "released")
                published, woken = queued, [run_id]
            else:
                cancelled = await cancel_instead(conn, run_id, epoch, handed_over=handed_over)
                if cancelled is None:
                    return False
                (row, published), woken = cancelled, handed_over
        await self._publisher.publish(run_id, row.last_seq - len(published) + 1, published)
        if woken:
            self._publisher.wake(woken)
        return True


def _index(part: PartRow) -> int:
    return part.index
