"""The faults: a seeded schedule laid out before the soak starts (so a seed names the same faults
in the same order at the same offsets), executed one at a time, each recorded as an outage
window; and the recovery time of every run a killed worker held."""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import time
from dataclasses import dataclass, field

from sqlalchemy import select

from tests.drill.infra import BACKEND, LEASE_TTL_S, World, start_worker
from tether.db.engine import create_engine
from tether.db.schema import runs

log = logging.getLogger("drill.chaos")

# Per minute of soak: several worker kills, one of each of the rest.
WORKER_KILLS_PER_MINUTE = 5
OTHER_FAULTS = (
    "kill_orchestrator",
    "kill_admission",
    "kill_interactions",
    "kill_gateway",
    "restart_postgres",
    "restart_redis",
    "freeze_worker",
)
PG_DOWN_S = 3.0
RESTART_BOUND_S = 120.0
LATE_S = 30.0
RECOVERY_BOUND_S = 60.0
# After a fault ends, calls may still meet its after-effects (reconnects) for this long.
OUTAGE_TAIL_S = 3.0


def schedule(seed: int, duration_s: float) -> list[tuple[float, str]]:
    """The faults of a soak of `duration_s` seconds: (offset from the start, kind), in order."""
    rng = random.Random(seed)
    minutes = max(duration_s / 60.0, 1 / 60)
    kinds = ["kill_worker"] * max(3, round(WORKER_KILLS_PER_MINUTE * minutes))
    kinds += [k for _ in range(max(1, round(minutes))) for k in OTHER_FAULTS]
    rng.shuffle(kinds)
    # Leave the first seconds for the load to start, and the last quarter as slack for a
    # loaded machine (a fault is not begun after the load ends).
    start, end = 3.0, max(duration_s * 0.75, 5.0)
    step = (end - start) / len(kinds)
    return [
        (round(start + i * step + rng.uniform(0, step * 0.5), 2), kind)
        for i, kind in enumerate(kinds)
    ]


@dataclass
class Outage:
    """One fault, from its first blow until what it broke serves again."""

    kind: str
    target: str
    start: float
    end: float = 0.0


@dataclass
class ChaosLog:
    """What the faults did."""

    outages: list[Outage] = field(default_factory=list)
    recoveries_s: list[float] = field(default_factory=list)
    unrecovered: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    kills_unmeasured: int = 0


class Chaos:
    """Executes a schedule against the world."""

    def __init__(self, world: World, seed: int, chaos_log: ChaosLog, *, workers: int) -> None:
        self._world = world
        self._workers = workers
        self._rng = random.Random(seed + 1)
        self._log = chaos_log
        self._watchers: list[asyncio.Task[None]] = []
        self._busy: set[str] = set()
        self._until = float("inf")
        self._engine = create_engine(world.db_url, pool_size=2)

    async def run(self, plan: list[tuple[float, str]], t0: float, until: float) -> None:
        """Each fault at its offset from `t0`. A fault runs as its own task (a restart can take
        longer than the gap to the next fault), never on a target another fault still holds.
        Every planned fault happens: one that a starved event loop reaches after `until` still
        does (settling starts once the last one is over); one that finds no free target by
        `until` plus LATE_S is reported skipped."""
        tasks: list[asyncio.Task[None]] = []
        self._until = until + LATE_S
        try:
            for offset, kind in plan:
                delay = t0 + offset - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)  # the schedule's moment
                tasks.append(asyncio.create_task(self._guarded(kind)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.heal()

    async def _guarded(self, kind: str) -> None:
        try:
            await self._fault(kind)
        except Exception as exc:  # a fault that could not be done is reported, and fails
            log.exception("fault %s failed", kind)
            self._log.errors.append(f"{kind}: {exc!r}")

    async def finish(self) -> None:
        """Wait for the recovery watchers (each bounded) and release the engine."""
        await asyncio.gather(*self._watchers, return_exceptions=True)
        await self._engine.dispose()

    async def heal(self) -> None:
        """Whatever a fault left broken is mended: frozen workers resumed, dead services
        started again, PostgreSQL up."""
        if not await self._world.postgres.running():
            await self._world.postgres.restart()
        live_workers = 0
        for name, proc in list(self._world.services.procs.items()):
            if proc.process.poll() is None:
                proc.process.send_signal(signal.SIGCONT)
                live_workers += name.startswith("worker")
            elif not name.startswith("worker"):
                await self._world.services.restart(name, timeout=RESTART_BOUND_S)
        for _ in range(self._workers - live_workers):
            await start_worker(self._world.services)

    def _outage(self, kind: str, target: str) -> Outage:
        outage = Outage(kind, target, time.monotonic())
        self._log.outages.append(outage)
        log.info("fault %s on %s", kind, target)
        return outage

    def _free(self, names: list[str]) -> str | None:
        """A seeded pick among `names` no other fault holds, now held; None when all are."""
        free = sorted(n for n in names if n not in self._busy)
        if not free:
            return None
        victim = self._rng.choice(free)
        self._busy.add(victim)
        return victim

    async def _fault(self, kind: str) -> None:
        names = self._targets(kind)
        victim = self._free(names)
        while victim is None and time.monotonic() < self._until:
            await asyncio.sleep(0.2)  # every target is held by another fault (or starting)
            victim = self._free(self._targets(kind))
        if victim is None:
            self._log.skipped.append(kind)
            return
        try:
            await self._strike(kind, victim)
        finally:
            if kind != "kill_worker":  # a killed worker stays dead; its replacement is new
                self._busy.discard(victim)

    def _targets(self, kind: str) -> list[str]:
        procs = self._world.services.procs
        if kind in ("kill_worker", "freeze_worker"):
            return [
                n for n, p in procs.items() if n.startswith("worker") and p.process.poll() is None
            ]
        if kind == "kill_gateway":
            return [n for n in procs if n.startswith("gateway")]
        if kind.startswith("kill_"):
            return [kind.removeprefix("kill_")]
        return [kind.removeprefix("restart_")]

    async def _strike(self, kind: str, victim: str) -> None:
        services = self._world.services
        if kind == "kill_worker":
            try:
                held: list[str] | None = await self._held_by(victim)
            except Exception:  # PostgreSQL is down (another fault): kill it, unmeasured
                held = None
                self._log.kills_unmeasured += 1
            outage = self._outage(kind, victim)
            services.kill(victim)
            self._watch_recovery(victim, held or [], outage.start)
            await start_worker(services)
        elif kind.startswith("kill_"):
            assert victim.split("-")[0] in (*BACKEND, "gateway")
            outage = self._outage(kind, victim)
            # SIGKILL, then the same instance on its ports (a start on a loaded machine has
            # been seen to take over a minute).
            await services.restart(victim, timeout=RESTART_BOUND_S)
        elif kind == "restart_postgres":
            outage = self._outage(kind, victim)
            await self._world.postgres.kill()
            await asyncio.sleep(PG_DOWN_S)  # how long the database stays down
            await self._world.postgres.restart()
        elif kind == "restart_redis":
            outage = self._outage(kind, victim)
            await self._world.restart_redis(flush=True)
        elif kind == "freeze_worker":
            outage = self._outage(kind, victim)
            proc = services.procs[victim].process
            proc.send_signal(signal.SIGSTOP)
            try:
                await asyncio.sleep(LEASE_TTL_S * 3)  # past its lease: the reaper moves on
            finally:
                proc.send_signal(signal.SIGCONT)
        else:
            raise ValueError(f"unknown fault {kind!r}")
        outage.end = time.monotonic()

    async def _held_by(self, worker: str) -> list[str]:
        async with self._engine.connect() as conn:
            rows = await conn.execute(
                select(runs.c.run_id).where(
                    runs.c.lease_owner == worker, runs.c.status == "running"
                )
            )
            return [r.run_id for r in rows]

    def _watch_recovery(self, worker: str, held: list[str], killed_at: float) -> None:
        for run_id in held:
            self._watchers.append(asyncio.create_task(self._recovery(worker, run_id, killed_at)))

    async def _recovery(self, worker: str, run_id: str, killed_at: float) -> None:
        """Time from the kill until the run runs again on another worker or has moved on
        (finished, parked, waiting for its retry)."""
        while time.monotonic() - killed_at < RECOVERY_BOUND_S:
            try:
                async with self._engine.connect() as conn:
                    row = (
                        await conn.execute(
                            select(runs.c.status, runs.c.lease_owner).where(runs.c.run_id == run_id)
                        )
                    ).one()
            except Exception:  # PostgreSQL may be the next fault; look again
                row = None
            if row is not None and (
                (row.status != "running" and row.status != "queued")
                or (row.status == "running" and row.lease_owner not in (None, worker))
            ):
                self._log.recoveries_s.append(round(time.monotonic() - killed_at, 3))
                return
            await asyncio.sleep(0.05)  # a poll of the database is the measurement itself
        self._log.unrecovered.append(run_id)
