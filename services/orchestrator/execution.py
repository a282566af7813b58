"""Execution: what workers call under a lease (claim, heartbeat, checkpoint, park, retry,
complete, release, effects) and what the interactions service calls to resume a run.

Every worker write is fenced by the lease epoch; a stale epoch is StaleLease
(FAILED_PRECONDITION) and the worker abandons the attempt. Events are published to Redis only
after their transaction commits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.orchestrator import routing
from services.orchestrator.repositories import leases as lease_repo
from services.orchestrator.repositories import progress as repo
from services.orchestrator.repositories.progress import PartRow
from services.orchestrator.repositories.runs import get_run
from services.orchestrator.wakeups import Wakeups
from tether import states
from tether.bus import Bus
from tether.db.schema import runs
from tether.db.transitions import NOW, Event, apply
from tether.errors import FailedPrecondition, InvalidArgument, StaleLease, TetherError
from tether.hints import LiveMessage, encode_event, events_channel
from tether.pricing import Price, cost_micros
from tether.retry import RetryPolicy
from tether.states import RunStatus

log = logging.getLogger(__name__)

# How long a tenant's routing is reused; a changed agent configuration applies within this.
ROUTING_CACHE_S = 5.0


@dataclass(frozen=True)
class Claimed:
    """A leased run with the attempt's explicit inputs."""

    run: Row[Any]
    config: routing.AgentConfig
    history: list[PartRow]
    prior_part_count: int
    prior_inputs: list[tuple[int, str]]
    started: Event


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
_PARK = {
    RunStatus.WAITING_FOR_QUESTION: states.PARK_QUESTION,
    RunStatus.WAITING_FOR_APPROVAL: states.PARK_APPROVAL,
    RunStatus.WAITING_FOR_CONNECTION: states.PARK_CONNECTION,
}
_TERMINAL_EVENT = {
    RunStatus.COMPLETED: "run.completed",
    RunStatus.FAILED: "run.failed",
    RunStatus.CANCELLED: "run.cancelled",
}


# The last seq of a run claimed for the first time: run.queued, then run.started.
FRESH_RUN_SEQ = 2

# The error of a run that ended cancelled because a caller asked.
CANCELLED = {"code": "cancelled", "message": "cancelled by caller"}


class Execution:
    """The orchestrator's write side for runs under (or between) leases."""

    def __init__(
        self,
        engine: AsyncEngine,
        bus: Bus | None,
        *,
        lease_ttl_s: float,
        claim_poll_s: float,
        history_runs: int = 50,
    ) -> None:
        self._engine = engine
        # Single-statement writes need no BEGIN/COMMIT round trips.
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._bus = bus
        self._ttl = lease_ttl_s
        self._claim_poll = claim_poll_s
        self._history_runs = history_runs
        # Waiting claims, woken one per run that may have become claimable.
        self.wakeups = Wakeups()
        # Marks this replica's own wake-up messages, which come back to it through Redis.
        self.wake_marker = f"orchestrator-{uuid.uuid4().hex}"
        self._empty_as_of = -1  # wakeups.generation when the last look that found nothing began
        # Set (and replaced) when this replica schedules a retry: the scheduler looks again.
        self._retry_scheduled = asyncio.Event()
        # Prices of the runs this replica leased, so pricing a turn costs no query.
        self._prices: dict[str, dict[str, Any]] = {}
        self._routes: dict[str, tuple[float, routing.AgentConfig]] = {}

    # -- publishing -------------------------------------------------------------------------

    async def _publish(
        self, run_id: str, first_seq: int, events: Sequence[Event], *, delivered: bool = False
    ) -> None:
        """Post committed events; with `delivered`, return once they reached Redis."""
        if self._bus is None or not events:
            return
        now = datetime.now(UTC).isoformat()
        for i, event in enumerate(events):
            message = LiveMessage(run_id, first_seq + i, event.type, event.payload, now)
            self._bus.post(events_channel(run_id), encode_event(message))
        if delivered:
            await self._bus.delivered()

    def _wake_workers(self, run_ids: Sequence[str] = ("",)) -> None:
        """These runs ("" for one not known by id) may have become claimable: wake a claim
        for each here and, through Redis, on every other replica."""
        self.wakeups.wake(run_ids)
        if self._bus is not None:
            for run_id in run_ids:
                self._bus.notify_queued(run_id, self.wake_marker)

    # -- claim --------------------------------------------------------------------------------

    async def claim(self, worker_id: str, wait_s: float) -> Claimed | None:
        """Lease the oldest claimable run, waiting up to `wait_s` for one to appear."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        first = True
        while True:
            ticket = self.wakeups.ticket()  # before looking: a wake-up during the look counts
            claimed = None
            try:
                generation = self.wakeups.generation
                # A new claim that will wait skips the look while nothing woke since one found
                # nothing: its ticket is in line, so the next wake-up (or the poll) is its own.
                if not (first and wait_s > 0 and generation == self._empty_as_of):
                    claimed = await self._claim_once(worker_id)
                    if claimed is None:
                        self._empty_as_of = max(self._empty_as_of, generation)
                first = False
                if claimed is not None or loop.time() >= deadline:
                    taken = None if claimed is None else str(claimed.run.run_id)
                    self.wakeups.leave(ticket, claimed=taken)
                    return claimed
                # Woken by Redis (admission, resumption), locally, or by the replica's poll
                # (poll_claimable) when a wake-up was lost.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ticket, deadline - loop.time())
            except BaseException:
                self.wakeups.leave(ticket, claimed=None)  # failed, or the caller went away
                raise
            self.wakeups.leave(ticket, claimed=None, looking_again=True)

    async def poll_claimable(self) -> None:
        """The fallback for wake-ups lost on the way: every claim poll interval, while claims
        wait here, count the claimable runs and wake that many. One cheap query per replica,
        however many claims wait (each polling for itself cost a transaction per claim)."""
        while True:
            await asyncio.sleep(self._claim_poll)
            waiting = self.wakeups.waiting
            if not waiting:
                continue
            try:
                async with self._autocommit.connect() as conn:
                    claimable = await lease_repo.count_claimable(conn, waiting)
            except Exception:
                log.exception("claim poll failed; trying again in %.1f s", self._claim_poll)
                continue
            if claimable:
                self.wakeups.wake([""] * claimable)

    async def _claim_once(self, worker_id: str) -> Claimed | None:
        broken: tuple[str, TetherError] | None = None
        async with self._engine.begin() as conn:
            candidate = await lease_repo.pick_candidate(conn)
            if candidate is None:
                return None
            routing_start = time.perf_counter()
            try:
                config = await self._routing(conn, candidate.tenant_id)
            except TetherError as exc:
                broken = (candidate.run_id, exc)
            else:
                routing_ms = (time.perf_counter() - routing_start) * 1000
                claimed = await self._lease(conn, candidate, worker_id, config, routing_ms)
        if broken is None:
            await self._publish(claimed.run.run_id, claimed.run.last_seq, [claimed.started])
            return claimed
        if broken is not None:
            # Routing failed after admission: finalise the run rather than leave it queued
            # for every worker to trip over.
            run_id, failure = broken
            log.warning("routing failed for %s: %s", run_id, failure.message)
            await self.fail_unleased(
                run_id, {"code": "routing_failed", "message": failure.message, "retryable": False}
            )
        return None

    async def _routing(self, conn: AsyncConnection, tenant_id: str) -> routing.AgentConfig:
        """The tenant's agent configuration, cached briefly (a claim should not re-read it)."""
        now = asyncio.get_running_loop().time()
        cached = self._routes.get(tenant_id)
        if cached is not None and cached[0] > now:
            return cached[1]
        config = routing.resolve(await lease_repo.tenant_agent(conn, tenant_id))
        if len(self._routes) > 10_000:
            self._routes.clear()
        self._routes[tenant_id] = (now + ROUTING_CACHE_S, config)
        return config

    async def _lease(
        self,
        conn: AsyncConnection,
        candidate: Any,
        worker_id: str,
        config: routing.AgentConfig,
        routing_ms: float,
    ) -> Claimed:
        run_id = candidate.run_id
        leased = await lease_repo.lease(
            conn,
            candidate,
            worker_id=worker_id,
            ttl_s=self._ttl,
            config=config.to_json(),
            max_attempts=config.limits.max_attempts,
            routing_ms=routing_ms,
        )
        if leased is None:  # the row is locked by us; a miss means a bug, not a race
            raise FailedPrecondition(f"run {run_id} could not be leased")
        if len(self._prices) > 10_000:  # runs finished elsewhere leave entries behind
            self._prices.clear()
        self._prices[run_id] = {m: dict(p) for m, p in config.prices.items()}
        prior, prior_inputs = await self._session_history(conn, leased)
        # A log of only run.queued and this run.started means nothing was written yet.
        own = await repo.list_parts(conn, run_id) if leased.last_seq > FRESH_RUN_SEQ else []
        started = Event(
            "run.started",
            {"attempt": leased.attempt, "workerId": worker_id, "leaseEpoch": leased.lease_epoch},
        )
        return Claimed(leased, config, prior + own, len(prior), prior_inputs, started)

    async def _session_history(
        self, conn: AsyncConnection, run: Row[Any]
    ) -> tuple[list[PartRow], list[tuple[int, str]]]:
        """Parts of the session's earlier completed runs (one query), with where each run's
        input goes."""
        rows = await repo.session_history(
            conn, run.session_id, run.created_at, limit_runs=self._history_runs
        )
        parts: list[PartRow] = []
        inputs: list[tuple[int, str]] = []
        current = None
        for row in rows:
            if row.run_id != current:
                current = row.run_id
                inputs.append((len(parts), row.input_text))
            if row.part_index is not None:
                parts.append(
                    PartRow(row.part_index, row.role, row.kind, dict(row.payload), row.final)
                )
        return parts, inputs

    # -- under the lease ----------------------------------------------------------------------

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
            priced = await self._priced(conn, run_id, turns)
            fenced = await repo.checkpoint(
                conn, run_id, epoch, self._ttl, parts, events, priced, batch=batch
            )
        if fenced is None:
            # A numbered batch that landed already came with the completion, which ended the
            # lease: from here both cases are the same refusal.
            raise StaleLease(f"lease epoch {epoch} of run {run_id} is no longer current")
        # The worker's next live deltas go out when this returns: they must not overtake these.
        await self._publish(run_id, fenced.last_seq - len(events) + 1, events, delivered=True)
        return fenced

    async def _priced(
        self, conn: AsyncConnection, run_id: str, turns: Sequence[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        if not turns:
            return []
        prices = self._prices.get(run_id)
        if prices is None:  # leased by another replica, or before a restart
            row = (await conn.execute(select(runs.c.config).where(runs.c.run_id == run_id))).one()
            prices = dict((row.config or {}).get("prices", {}))
        out = []
        for turn in turns:
            price_row = prices.get(turn.get("model", ""))
            price = Price(**price_row) if price_row else None
            out.append({**turn, "cost_micros": cost_micros(turn, price)})
        return out

    async def store_tool_output(self, run_id: str, epoch: int, ref: str, content: str) -> None:
        """Keep a whole tool output under the lease."""
        async with self._engine.begin() as conn:
            if await repo.fence(conn, run_id, epoch, 0, self._ttl) is None:
                raise StaleLease(f"lease epoch {epoch} of run {run_id} is no longer current")
            await repo.store_tool_output(conn, run_id, ref, content)

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
            priced = await self._priced(conn, run_id, done.turns)
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
                cancelled = await self._cancel_instead(
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
        self._prices.pop(run_id, None)
        if landed is not None and done.in_flight is not None:
            early = done.in_flight.events
            await self._publish(run_id, landed.last_seq - len(early) + 1, early)
        await self._publish(run_id, row.last_seq - len(events) + 1, events)
        if handed_over:
            self._wake_workers(handed_over)  # the session's next message may now run
        return row

    async def _cancel_instead(
        self,
        conn: AsyncConnection,
        run_id: str,
        epoch: int,
        *,
        before: Sequence[Event] = (),
        handed_over: list[str] | None = None,
    ) -> tuple[Row[Any], list[Event]] | None:
        """End cancelled, under the lease, a run whose move yielded to an accepted cancel: open
        calls closed as interrupted, the attempt closed as cancelled; the row and the events
        appended (`before` first). None when the lease is stale instead: the same fence (status
        and epoch, without the cancel guard) refuses this move too."""
        attempt, parts = await repo.attempt_and_parts(conn, run_id)
        closing = repo.close_attempt(
            parts, attempt, regenerated=False, interrupted="the run was cancelled"
        )
        events = [
            *before,
            *closing.events,
            Event("run.cancelled", {"reason": CANCELLED["message"]}),
        ]
        row = await apply(
            conn,
            states.CANCEL_BY_WORKER,
            run_id,
            epoch=epoch,
            events=events,
            handed_over=handed_over,
            values={
                **lease_repo.lease_cleared(),
                "finished_at": NOW,
                "error": CANCELLED,
                "usage": await repo.usage_total(conn, run_id),
            },
        )
        if row is None:
            return None
        await repo.write_closing(conn, run_id, epoch, closing)
        await lease_repo.end_attempt(conn, run_id, epoch, "cancelled", error=CANCELLED)
        return row, events

    async def _land_in_flight(
        self, conn: AsyncConnection, run_id: str, epoch: int, batch: Batch | None
    ) -> Row[Any] | None:
        """Write the checkpoint the worker sent but had no answer for, unless it landed
        already; the fenced row when this wrote it. A stale lease writes nothing here, and the
        completion's own fenced statement refuses it next."""
        if batch is None:
            return None
        priced = await self._priced(conn, run_id, batch.turns)
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
                "usage": {k: v for k, v in _camel(usage).items() if v},
            }
        if done.status is RunStatus.FAILED:
            return {"error": _camel(done.error or {})}
        return {"reason": (done.error or {}).get("message", "cancelled")}

    async def schedule_retry(
        self, run_id: str, epoch: int, error: dict[str, Any], retry_after_s: float
    ) -> Row[Any]:
        """Retry-pending with a backoff (at least the server's retry-after), or failed when the
        attempt budget is spent (the last error preserved); cancelled when a cancel was
        accepted first."""
        handed_over: list[str] = []
        async with self._engine.begin() as conn:
            run = (await conn.execute(select(runs).where(runs.c.run_id == run_id))).one()
            if run.status != "running" or run.lease_epoch != epoch:
                raise StaleLease(f"lease epoch {epoch} of run {run_id} is no longer current")
            limits = (run.config or {}).get("limits", {})
            policy = RetryPolicy(
                max_attempts=int(limits.get("max_attempts", run.max_attempts)),
                initial_delay=float(limits.get("backoff_initial_seconds", 0.5)),
                max_delay=float(limits.get("backoff_max_seconds", 8.0)),
            )
            if run.attempt >= policy.max_attempts:
                failed = Event("run.failed", {"error": _camel(error)})
                row, published = await self._fail_exhausted(
                    conn, run, epoch, error, failed, handed_over
                )
            else:
                delay = max(policy.backoff(run.attempt - 1), retry_after_s)
                next_at = datetime.now(UTC) + timedelta(seconds=delay)
                pending = Event(
                    "run.retry-pending",
                    {
                        "attempt": run.attempt,
                        "maxAttempts": policy.max_attempts,
                        "nextAttemptAt": next_at.isoformat().replace("+00:00", "Z"),
                        "error": _camel(error),
                    },
                )
                # The next attempt streams the cut-off turn anew; its calls left whole run then.
                closing = repo.close_attempt(
                    await repo.list_parts(conn, run_id),
                    run.attempt,
                    regenerated=True,
                    interrupted=None,
                )
                events = [*closing.events, pending]
                moved = await apply(
                    conn,
                    states.SCHEDULE_RETRY,
                    run_id,
                    epoch=epoch,
                    events=events,
                    values={
                        **lease_repo.lease_cleared(),
                        "next_attempt_at": next_at,
                        "error": error,
                    },
                )
                if moved is None:
                    cancelled = await self._cancel_instead(
                        conn, run_id, epoch, handed_over=handed_over
                    )
                    if cancelled is None:
                        raise StaleLease(f"run {run_id} moved before its retry was scheduled")
                    row, published = cancelled
                else:
                    await repo.write_closing(conn, run_id, epoch, closing)
                    await lease_repo.end_attempt(conn, run_id, epoch, "retry-pending", error=error)
                    row, published = moved, events
        await self._publish(run_id, row.last_seq - len(published) + 1, published)
        if row.status != RunStatus.RETRY_PENDING.value:
            self._wake_workers(handed_over or ("",))
        else:
            fired, self._retry_scheduled = self._retry_scheduled, asyncio.Event()
            fired.set()
        return row

    async def _fail_exhausted(
        self,
        conn: AsyncConnection,
        run: Row[Any],
        epoch: int,
        error: dict[str, Any],
        event: Event,
        handed_over: list[str],
    ) -> tuple[Row[Any], list[Event]]:
        closing = repo.close_attempt(
            await repo.list_parts(conn, run.run_id),
            run.attempt,
            regenerated=False,
            interrupted="the model call failed",
        )
        events = [*closing.events, event]
        row = await apply(
            conn,
            states.FAIL,
            run.run_id,
            epoch=epoch,
            events=events,
            handed_over=handed_over,
            values={
                **lease_repo.lease_cleared(),
                "finished_at": NOW,
                "error": error,
                "usage": await repo.usage_total(conn, run.run_id),
            },
        )
        if row is None:
            cancelled = await self._cancel_instead(conn, run.run_id, epoch, handed_over=handed_over)
            if cancelled is None:
                raise StaleLease(f"run {run.run_id} moved before it could fail")
            return cancelled
        await repo.write_closing(conn, run.run_id, epoch, closing)
        await lease_repo.end_attempt(conn, run.run_id, epoch, "failed", error=error)
        return row, events

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
                cancelled = await self._cancel_instead(conn, run_id, epoch, handed_over=handed_over)
                if cancelled is None:
                    return False
                (row, published), woken = cancelled, handed_over
        await self._publish(run_id, row.last_seq - len(published) + 1, published)
        if woken:
            self._wake_workers(woken)
        return True

    async def park(self, run_id: str, epoch: int, status: RunStatus, interaction_id: str) -> bool:
        """Park a run for a person: lease released, session kept, no worker held. A run whose
        cancel was accepted ends cancelled instead of waiting for anyone."""
        transition = _PARK.get(status)
        if transition is None:
            raise InvalidArgument("status must be one of the waiting-for-* statuses")
        event = Event(transition.event_type, {"interactionId": interaction_id})
        handed_over: list[str] = []
        async with self._engine.begin() as conn:
            row = await apply(
                conn,
                transition,
                run_id,
                epoch=epoch,
                events=[event],
                values={**lease_repo.lease_cleared(), "waiting_interaction_id": interaction_id},
            )
            if row is not None:
                await lease_repo.end_attempt(conn, run_id, epoch, status.value)
                published = [event]
            else:
                cancelled = await self._cancel_instead(conn, run_id, epoch, handed_over=handed_over)
                if cancelled is None:
                    raise StaleLease(f"lease epoch {epoch} of run {run_id} is no longer current")
                row, published = cancelled
        await self._publish(run_id, row.last_seq - len(published) + 1, published)
        if handed_over:
            self._wake_workers(handed_over)  # the session's next message may now run
        return True

    async def resume(
        self,
        tenant_id: str,
        run_id: str,
        from_status: RunStatus,
        event: Event | None,
        interaction_id: str,
    ) -> bool:
        """Queue a run parked on `interaction_id` once; False when it had already moved or
        waits on another interaction (an orphan, stored by a worker that died before parking
        on it, wakes nothing)."""
        if not from_status.waiting:
            raise InvalidArgument("from_status must be a waiting-for-* status")
        if not interaction_id:
            raise InvalidArgument("interaction_id is required: a resume names the pause it ends")
        events = [event] if event else []
        queued = Event("run.queued", {"reason": "resumed"})
        async with self._engine.begin() as conn:
            await get_run(conn, tenant_id, run_id)
            row = await apply(
                conn,
                states.RESUME,
                run_id,
                tenant_id=tenant_id,
                waiting_on=interaction_id,
                events=[*events, queued],
                values={"waiting_interaction_id": None},
            )
        if row is None:
            return False
        await self._publish(run_id, row.last_seq - len(events), [*events, queued])
        self._wake_workers([run_id])
        return True

    async def expire_waiting(
        self,
        tenant_id: str,
        run_id: str,
        from_status: RunStatus,
        error: dict[str, Any],
        event: Event | None,
        interaction_id: str,
    ) -> bool:
        """Fail a run whose pause on `interaction_id` outlived its TTL; False when it had
        already moved or waits on another interaction."""
        if from_status is not RunStatus.WAITING_FOR_CONNECTION:
            raise InvalidArgument("only a waiting-for-connection run expires")
        if not interaction_id:
            raise InvalidArgument("interaction_id is required: an expiry names the pause it ends")
        failed = Event("run.failed", {"error": _camel(error)})
        events = [*([event] if event else []), failed]
        async with self._engine.begin() as conn:
            row = await apply(
                conn,
                states.CONSENT_EXPIRED,
                run_id,
                tenant_id=tenant_id,
                waiting_on=interaction_id,
                events=events,
                values={"error": error, "finished_at": NOW, "waiting_interaction_id": None},
            )
            if row is not None:
                await repo.close_dangling(conn, row, "the connection was never completed")
        if row is None:
            return False
        await self._publish(run_id, row.last_seq - len(events) + 1, events)
        self._wake_workers()
        return True

    # -- effects ------------------------------------------------------------------------------

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

    # -- maintenance ---------------------------------------------------------------------------

    async def reap_expired(self, limit: int = 100) -> int:
        """Requeue (attempt + 1) or fail runs whose worker stopped heartbeating."""
        published: list[tuple[str, int, list[Event]]] = []
        async with self._engine.begin() as conn:
            for run in await lease_repo.expired_leases(conn, limit):
                requeue = run.cancel_requested_at is None and run.attempt < run.max_attempts
                closing = repo.close_attempt(
                    await repo.list_parts(conn, run.run_id),
                    run.attempt,
                    regenerated=requeue,
                    interrupted="the worker lost its lease",
                )
                events = list(closing.events)
                error = {
                    "code": "lease_expired",
                    "retryable": True,
                    "message": f"worker {run.lease_owner} stopped heartbeating",
                }
                values: dict[str, Any] = {
                    **lease_repo.lease_cleared(),
                    "error": error,
                    "finished_at": NOW,
                }
                if run.cancel_requested_at is not None:
                    # Cancelled while its worker was dying: nobody is left to stop, so the
                    # orchestrator finalises the cancellation itself.
                    error = {
                        "code": "cancelled",
                        "message": "cancelled by caller",
                        "retryable": True,
                    }
                    values["error"] = error
                    transition = states.CANCEL_BY_WORKER
                    events.append(Event("run.cancelled", {"reason": "cancelled by caller"}))
                elif requeue:
                    transition = states.REAP_REQUEUE
                    values = {**lease_repo.lease_cleared(), "attempt": run.attempt + 1}
                    events.append(lease_repo.queued_event(run.attempt + 1, "lease_expired"))
                else:
                    transition = states.REAP_FAIL
                    events.append(Event("run.failed", {"error": _camel(error)}))
                row = await apply(
                    conn,
                    transition,
                    run.run_id,
                    epoch=run.lease_epoch,
                    events=events,
                    values=values,
                )
                if row is not None:
                    await repo.write_closing(conn, run.run_id, run.lease_epoch, closing)
                    await lease_repo.end_attempt(
                        conn, run.run_id, run.lease_epoch, "lease_expired", error=error
                    )
                    published.append((run.run_id, row.last_seq - len(events) + 1, events))
        for run_id, first, events in published:
            await self._publish(run_id, first, events)
        if published:
            self._wake_workers([run_id for run_id, _, _ in published])
        return len(published)

    async def schedule_retries(self, max_wait_s: float) -> None:
        """Queue each retry-pending run when its backoff ends: sleep until the earliest one is
        due, woken early when this replica schedules one; at most `max_wait_s` between looks
        (retries scheduled by another replica, if that one is gone)."""
        while True:
            scheduled = self._retry_scheduled  # taken before looking: a later one still wakes
            wait_s = max_wait_s
            try:
                await self.queue_due_retries()
                async with self._autocommit.connect() as conn:
                    due_in = await lease_repo.next_retry_in(conn)
                if due_in is not None:
                    wait_s = min(max(due_in, 0.0), max_wait_s)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("retry scheduling round failed; looking again in %.1f s", wait_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(scheduled.wait(), wait_s)

    async def queue_due_retries(self, limit: int = 100) -> int:
        """Move retry-pending runs whose backoff elapsed back to queued (attempt + 1)."""
        published: list[tuple[str, int, Event]] = []
        async with self._engine.begin() as conn:
            for run in await lease_repo.due_retries(conn, limit):
                event = lease_repo.queued_event(run.attempt + 1, "retry")
                row = await apply(
                    conn,
                    states.RETRY_DUE,
                    run.run_id,
                    events=[event],
                    values={"attempt": run.attempt + 1, "next_attempt_at": None},
                )
                if row is not None:
                    published.append((run.run_id, row.last_seq, event))
        for run_id, seq, event in published:
            await self._publish(run_id, seq, [event])
        if published:
            self._wake_workers([run_id for run_id, _, _ in published])
        return len(published)

    async def fail_unleased(self, run_id: str, error: dict[str, Any]) -> None:
        """Fail a queued run that cannot even start (routing or context broken)."""
        failed = Event("run.failed", {"error": _camel(error)})
        handed_over: list[str] = []
        async with self._engine.begin() as conn:
            row = await apply(
                conn,
                states.FAIL_UNLEASED,
                run_id,
                events=[failed],
                values={"error": error, "finished_at": NOW},
                handed_over=handed_over,
            )
        if row is not None:
            await self._publish(run_id, row.last_seq, [failed])
        if handed_over:
            self._wake_workers(handed_over)  # the session's next message may now run


def _index(part: PartRow) -> int:
    return part.index


def _camel(data: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in data.items():
        head, *rest = key.split("_")
        out[head + "".join(w.capitalize() for w in rest)] = value
    return out
