"""Schedules: a tenant's recurring runs. Adding, listing, pausing, resuming and removing one
(each act audited), and the ticker that admits each tick as an inbound event like any other.

A tick is admitted through admission's own statement with the idempotency key (schedule, tick
time), in the transaction that moves the schedule on to its next fire time: tickers on any
number of replicas claim due schedules with `FOR UPDATE SKIP LOCKED`, so one fires a tick and
the others pass it by, and were two ever to fire the same tick its key admits it once.
Each tick is a conversation of its own, owned by the schedule's creator and pinned to its agent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.admission import repository as repo
from services.admission import schedule_repository as schedule_repo
from services.admission.cron import CatchUp, Cron, parse_overlap, plan
from services.admission.domain import ConversationKind, InboundEvent
from services.orchestrator.repositories import intake
from tether import audit
from tether.bus import Bus
from tether.domain.channels import pinned_channel
from tether.errors import InvalidArgument, NotFound
from tether.ids import is_identifier, new_id
from tether.limits import ID_CHARS, TEXT_CHARS
from tether.runtime.tasks import rounds
from tether.states import TERMINAL, RunStatus

log = logging.getLogger(__name__)

Clock = Callable[[], datetime]
SOURCE = "schedule"


def system_clock() -> datetime:
    """The time now, in UTC."""
    return datetime.now(UTC)


def file_clock(path: str) -> Clock:
    """A clock that reads the time from a file holding one ISO-8601 instant, read afresh each
    time: drills and tests move a replica's time across an outage of hours in a moment."""

    def now() -> datetime:
        with open(path, encoding="utf-8") as held:  # a few bytes; tests only
            return datetime.fromisoformat(held.read().strip()).astimezone(UTC)

    return now


@dataclass(frozen=True)
class Schedule:
    """A stored schedule."""

    tenant_id: str
    schedule_id: str
    principal_id: str
    agent: str
    cron: Cron
    message: str
    overlap: str
    catch_up: CatchUp
    next_fire_at: datetime
    paused: bool
    created_at: datetime
    last_tick_at: datetime | None
    last_run_id: str | None

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> Schedule:
        """The schedule a `schedules` row stores."""
        return cls(
            tenant_id=row["tenant_id"],
            schedule_id=row["schedule_id"],
            principal_id=row["principal_id"],
            agent=row["agent"],
            cron=Cron(row["cron"], row["timezone"]),
            message=row["message"],
            overlap=row["overlap"],
            catch_up=CatchUp(row["catch_up"], row["catch_up_window_s"]),
            next_fire_at=row["next_fire_at"],
            paused=row["paused_at"] is not None,
            created_at=row["created_at"],
            last_tick_at=row["last_tick_at"],
            last_run_id=row["last_run_id"],
        )


@dataclass(frozen=True)
class NewSchedule:
    """A schedule as asked for, validated."""

    agent: str
    cron: Cron
    message: str
    overlap: str
    catch_up: CatchUp

    @classmethod
    def parse(
        cls,
        *,
        agent: str,
        cron: str,
        timezone: str,
        message: str,
        overlap: str,
        catch_up: str,
        catch_up_window_s: int,
    ) -> NewSchedule:
        """The schedule, or InvalidArgument naming the first thing wrong with it."""
        if not is_identifier(agent, max_length=ID_CHARS):
            raise InvalidArgument(
                f"agent must name one of the tenant's agents (1-{ID_CHARS} characters of "
                f"letters, digits and . _ : @ -); got {agent[:40]!r}",
                details={"field": "agent"},
            )
        if not message.strip() or len(message) > TEXT_CHARS:
            raise InvalidArgument(
                f"message must be 1-{TEXT_CHARS} characters: what each tick's run is asked",
                details={"field": "message"},
            )
        return cls(
            agent,
            Cron.parse(cron, timezone),
            message,
            parse_overlap(overlap),
            CatchUp.parse(catch_up, catch_up_window_s),
        )


@dataclass(frozen=True)
class Actor:
    """Who acts on a schedule: the key's tenant and principal, and the key."""

    tenant_id: str
    principal_id: str
    key_id: str

    def audited(self) -> dict[str, str]:
        """The actor as the audit trail records it."""
        return {"kind": "key", "key_id": self.key_id, "principal_id": self.principal_id}


def tick_event(schedule: Schedule, tick: datetime) -> InboundEvent:
    """The inbound event a tick of `schedule` is: keyed by (schedule, tick time), a
    conversation of its own, the creator's, routed to the schedule's agent."""
    instant = int(tick.timestamp())
    tick_id = f"{schedule.schedule_id}@{instant}"
    return InboundEvent(
        tenant_id=schedule.tenant_id,
        principal_id=schedule.principal_id,
        source=SOURCE,
        event_id=tick_id,
        idempotency_key=f"{SOURCE}:{tick_id}",
        actor_type="schedule",
        actor_id=schedule.schedule_id,
        conversation_kind=ConversationKind.SCHEDULE,
        # The run's route channel names its agent (`schedule/reporter`), as a channel
        # connection that names one pins its runs to it.
        channel=pinned_channel(SOURCE, schedule.agent),
        conversation_id=tick_id,
        text=schedule.message,
        context={
            "schedule_id": schedule.schedule_id,
            "tick_at": tick.astimezone(UTC).isoformat(),
        },
    )


class Schedules:
    """The tenant-facing acts on schedules, each audited in its own transaction."""

    def __init__(self, engine: AsyncEngine, clock: Clock = system_clock) -> None:
        self._engine = engine
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._clock = clock

    async def create(self, actor: Actor, new: NewSchedule) -> Schedule:
        """Store `new` as the actor's, due at its first tick after now."""
        values = {
            "tenant_id": actor.tenant_id,
            "schedule_id": new_id("sch"),
            "principal_id": actor.principal_id,
            "agent": new.agent,
            "cron": new.cron.expression,
            "timezone": new.cron.timezone,
            "message": new.message,
            "overlap": new.overlap,
            "catch_up": new.catch_up.policy,
            "catch_up_window_s": new.catch_up.window_s,
            "next_fire_at": new.cron.next_after(self._clock()),
        }
        async with self._engine.begin() as conn:
            stored = Schedule.from_row((await schedule_repo.insert_schedule(conn, values))._mapping)
            await self._audit(conn, actor, "schedule.added", stored)
        return stored

    async def list(self, tenant_id: str) -> list[Schedule]:
        """The tenant's schedules, oldest first."""
        async with self._autocommit.connect() as conn:
            rows = await schedule_repo.tenant_schedules(conn, tenant_id)
        return [Schedule.from_row(row._mapping) for row in rows]

    async def set_paused(self, actor: Actor, schedule_id: str, paused: bool) -> Schedule:
        """Pause the schedule, or resume it from its first tick after now; one that is so
        already is returned unchanged (and nothing is audited)."""
        async with self._engine.begin() as conn:
            found = await self._find(conn, actor.tenant_id, schedule_id)
            if paused:
                row = await schedule_repo.pause(conn, actor.tenant_id, schedule_id)
            else:
                next_fire_at = found.cron.next_after(self._clock())
                row = await schedule_repo.resume(conn, actor.tenant_id, schedule_id, next_fire_at)
            if row is None:
                return found
            moved = Schedule.from_row(row._mapping)
            action = "schedule.paused" if paused else "schedule.resumed"
            await self._audit(conn, actor, action, moved)
        return moved

    async def remove(self, actor: Actor, schedule_id: str) -> None:
        """Remove the schedule (the runs it admitted stay)."""
        async with self._engine.begin() as conn:
            found = await self._find(conn, actor.tenant_id, schedule_id)
            if not await schedule_repo.remove(conn, actor.tenant_id, schedule_id):
                raise _absent(schedule_id)
            await self._audit(conn, actor, "schedule.removed", found)

    @staticmethod
    async def _find(conn: AsyncConnection, tenant_id: str, schedule_id: str) -> Schedule:
        row = await schedule_repo.find_schedule(conn, tenant_id, schedule_id)
        if row is None:
            raise _absent(schedule_id)
        return Schedule.from_row(row._mapping)

    @staticmethod
    async def _audit(conn: AsyncConnection, actor: Actor, action: str, schedule: Schedule) -> None:
        await audit.record(
            conn,
            tenant_id=actor.tenant_id,
            action=action,
            actor=actor.audited(),
            schedule_id=schedule.schedule_id,
            agent=schedule.agent,
            cron=schedule.cron.expression,
            timezone=schedule.cron.timezone,
        )


def _absent(schedule_id: str) -> NotFound:
    return NotFound(f"schedule {schedule_id!r} not found", details={"schedule_id": schedule_id})


@dataclass(frozen=True)
class TickerTiming:
    """How a ticker polls: how often, how many schedules per pass, and how late a tick may be
    and still count as on time (older ones were missed: the catch-up policy decides)."""

    poll_s: float = 1.0
    batch: int = 100
    grace_s: float = 60.0


class Ticker:
    """Fires due schedules on this replica: each pass claims the due ones and admits their
    ticks, each in the transaction that moves the schedule on."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        max_attempts: int,
        timing: TickerTiming,
        clock: Clock = system_clock,
        bus: Bus | None = None,
    ) -> None:
        self._engine = engine
        self._max_attempts = max_attempts
        self._timing = timing
        self._clock = clock
        self._bus = bus

    async def run(self) -> None:
        """Pass after pass, until cancelled; a failed pass (the database away) is logged and
        tried again at the next, and what it would have admitted is admitted then, late (the
        catch-up policy decides)."""
        poll_s = self._timing.poll_s
        await rounds(self._round, "schedules", least_s=poll_s, most_s=poll_s)

    async def _round(self) -> None:
        await self.tick()

    async def tick(self) -> list[str]:
        """One pass: fire every due schedule (a batch at a time); the runs it admitted."""
        admitted: list[str] = []
        while True:
            now = self._clock()
            batch: list[str] = []
            async with self._engine.begin() as conn:
                due = await schedule_repo.lock_due(conn, now, self._timing.batch)
                for row in due:
                    batch.extend(await self._fire(conn, Schedule.from_row(row._mapping), now))
            if self._bus is not None:
                for run_id in batch:
                    self._bus.notify_queued(run_id)
            admitted.extend(batch)
            if len(due) < self._timing.batch:
                return admitted

    async def _fire(self, conn: AsyncConnection, schedule: Schedule, now: datetime) -> list[str]:
        """Admit the ticks the catch-up policy fires (those the overlap policy lets through) and
        move the schedule on; the runs admitted."""
        planned = plan(schedule.cron, schedule.catch_up, schedule.next_fire_at, now, self._grace)
        admitted: list[str] = []
        last_tick, last_run = None, schedule.last_run_id
        for tick in planned.fire:
            if schedule.overlap == "skip" and await _active(conn, last_run):
                log.info(
                    "schedule %s: tick %s skipped, run %s still active",
                    schedule.schedule_id,
                    tick.isoformat(),
                    last_run,
                )
                continue
            run_id, created = await self._admit(conn, tick_event(schedule, tick))
            last_tick, last_run = tick, run_id or last_run
            if created and run_id is not None:
                admitted.append(run_id)
                log.info(
                    "schedule %s: tick %s admitted as run %s",
                    schedule.schedule_id,
                    tick.isoformat(),
                    run_id,
                )
        if planned.passed_over:
            log.info(
                "schedule %s: %d missed tick(s) passed over (catch-up %s)",
                schedule.schedule_id,
                planned.passed_over,
                schedule.catch_up.policy,
            )
        await schedule_repo.advance(
            conn,
            schedule.tenant_id,
            schedule.schedule_id,
            next_fire_at=planned.next_fire_at,
            last_tick_at=last_tick,
            last_run_id=last_run,
        )
        return admitted

    @property
    def _grace(self) -> float:
        return self._timing.grace_s

    async def _admit(self, conn: AsyncConnection, event: InboundEvent) -> tuple[str | None, bool]:
        """Admit a tick's event in the caller's transaction: its run (None: removed since) and
        whether this call created it (False: the tick was admitted before, under its key)."""
        run_id = new_id("run")
        params = repo.admit_params(
            event=event,
            request_hash=event.request_hash(),
            run_id=run_id,
            session_id=new_id("ses"),
            message_id=new_id("msg"),
            max_attempts=self._max_attempts,
            traceparent=None,
        )
        run = await repo.admit_new(conn, params)
        if run is not None:
            return run.run_id, True
        claim = await repo.find_claim(conn, event)
        return (claim.run.run_id if claim.run is not None else None), False


async def _active(conn: AsyncConnection, run_id: str | None) -> bool:
    """Whether the tick's run is queued, running or waiting (one removed since is not); a
    failed or cancelled one that a person retried is as active as its latest retry."""
    if not run_id:
        return False
    try:
        run = await intake.claimed_run(conn, run_id)
    except NotFound:
        return False
    status = RunStatus(run.status)
    if status in (RunStatus.FAILED, RunStatus.CANCELLED):
        status = RunStatus((await intake.latest_retry(conn, run_id)).status)
    return status not in TERMINAL
