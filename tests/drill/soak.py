"""One soak: start the world, run the load and the fault schedule for the given time, stop the
load, let runs in flight settle (bounded), check the invariants; returns the report."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from tests.drill import checker
from tests.drill.channel_load import ChannelLoad, ChannelObservations
from tests.drill.chaos import OUTAGE_TAIL_S, Chaos, ChaosLog, schedule
from tests.drill.flood_load import FloodLoad, FloodObservations
from tests.drill.infra import World, world
from tests.drill.load import Load, Observations
from tether.db.engine import create_engine
from tether.db.schema import interactions, runs

log = logging.getLogger("drill")


@dataclass(frozen=True)
class SoakConfig:
    """The knobs; a seed fixes the fault schedule and every client's choices."""

    seed: int
    minutes: float
    settle_s: float = 45.0
    workers: int = 3
    tenants: int = 4
    conversations: int = 2


async def soak(config: SoakConfig, work_dir: Path) -> dict[str, Any]:
    """Run the soak in `work_dir`; the report (see tests.drill.checker.evaluate)."""
    duration = config.minutes * 60.0
    plan = schedule(config.seed, duration)
    async with world(work_dir, workers=config.workers, tenants_count=config.tenants) as w:
        obs = Observations()
        chaos_log = ChaosLog()
        load = Load(w, random.Random(config.seed), obs)
        channel_obs = ChannelObservations()
        channel_load = ChannelLoad(w, random.Random(config.seed + 1), channel_obs)
        flood_obs = FloodObservations()
        flood_load = FloodLoad(w, random.Random(config.seed + 2), flood_obs)
        chaos = Chaos(w, config.seed, chaos_log, workers=config.workers)
        t0 = time.monotonic()
        load_end = t0 + duration
        load.settle_until = load_end + config.settle_s
        log.info("load and faults for %.0f s: %d faults planned", duration, len(plan))
        load_task = asyncio.create_task(load.run(config.conversations, load_end))
        channel_task = asyncio.create_task(channel_load.run(load_end))
        flood_task = asyncio.create_task(flood_load.run(load_end))
        try:
            await chaos.run(plan, t0, load_end)
            remaining = load_end - time.monotonic()
            if remaining > 0:
                await asyncio.sleep(remaining)  # the load runs to its end
            # Settling is counted from the moment the last fault is over.
            load.settle_until = max(load_end, time.monotonic()) + config.settle_s
            log.info("load stopped; settling for at most %.0f s", config.settle_s)
            await _settle(w, obs, load.settle_until)
        finally:
            for task in (load_task, channel_task, flood_task):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await load.close()
            await chaos.finish()
        state = await checker.read_state(w.db_url)
        seen = checker.Seen(
            transcripts=obs.transcripts,
            accepted_cancels=obs.accepted_cancels,
            calls=obs.calls,
            outages=[(o.start, (o.end or o.start) + OUTAGE_TAIL_S) for o in chaos_log.outages],
            conflicts_accepted=obs.conflicts_accepted,
            deliveries=obs.deliveries,
            decisions_accepted_twice=obs.decisions_accepted_twice,
            recoveries_s=chaos_log.recoveries_s,
            unrecovered=chaos_log.unrecovered,
            channel_runs=channel_obs.runs_by_event,
            channel_replies={
                event_id: sum(1 for m in w.slack.thread(*where) if m.bot_id is not None)
                for event_id, where in channel_obs.threads.items()
            },
            flood_tenant=w.flood_tenant.tenant_id,
        )
        report = checker.evaluate(state, w.ledger.records, seen)
        report_replies = seen.channel_replies
        report["durability"] = w.postgres.settings
        report["faults"] = dict(sorted(Counter(o.kind for o in chaos_log.outages).items()))
        report["faults_failed"] = chaos_log.errors
        report["faults_skipped"] = chaos_log.skipped  # their target was still down
        report["recovery_after_worker_kill_s"]["kills_unmeasured"] = chaos_log.kills_unmeasured
        report["load"] = {
            "scenarios": dict(sorted(obs.scenarios.items())),
            "calls": len(obs.calls),
            "calls_by_code": dict(sorted(Counter(c.code for c in obs.calls).items())),
            "sends_failed": obs.sends_failed,
            "duplicate_deliveries": obs.duplicates_sent,
            "conflicting_deliveries": obs.conflicts_sent,
            "duplicate_decisions": obs.duplicate_decisions_sent,
            "accepted_cancels": len(obs.accepted_cancels),
            "stream_resumes": sum(t.resumes for t in obs.transcripts.values()),
            "ledger_records": len(w.ledger.records),
            "channel_messages": channel_obs.sent,
            "channel_redeliveries": channel_obs.redelivered,
            "channel_refused": {str(k): v for k, v in sorted(channel_obs.refused.items())},
            "channel_answers": sum(report_replies.values()),
            "flood_sent": flood_obs.sent,
            "flood_sends_failed": flood_obs.failed,
            "flood_backlog_max": flood_obs.backlog_max,
            "quiet_tenant_runs": flood_obs.quiet_sent,
        }
    return report


async def _settle(w: World, obs: Observations, until: float) -> None:
    """Until every run is terminal or waiting on a person and every client saw the end of each
    terminal run it watches, or `until`."""
    engine = create_engine(w.db_url, pool_size=1)
    try:
        while time.monotonic() < until:
            try:
                moving, finished = await _unsettled(engine)
            except Exception:  # the database may still be recovering from the last fault
                moving, finished = 1, set()
            unseen = [
                run_id
                for run_id in finished
                if run_id in obs.transcripts and not obs.transcripts[run_id].terminal
            ]
            if moving == 0 and not unseen:
                return
            await asyncio.sleep(0.5)  # polling the database is how settling is observed
        log.warning("runs still moving when the settle time ran out")
    finally:
        await engine.dispose()


async def _unsettled(engine: Any) -> tuple[int, set[str]]:
    """(runs that are neither terminal nor parked on a pending interaction, terminal run ids)"""
    pending = (
        select(interactions.c.run_id).where(interactions.c.status == "pending").scalar_subquery()
    )
    async with engine.connect() as conn:
        moving = (
            await conn.execute(
                select(func.count())
                .select_from(runs)
                .where(
                    runs.c.status.not_in(checker.TERMINAL),
                    ~(runs.c.status.in_(checker.WAITING) & runs.c.run_id.in_(pending)),
                )
            )
        ).scalar_one()
        finished = {
            r.run_id
            for r in await conn.execute(
                select(runs.c.run_id).where(runs.c.status.in_(checker.TERMINAL))
            )
        }
    return int(moving), finished
