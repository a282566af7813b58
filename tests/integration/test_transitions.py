"""Transitions against the real PostgreSQL: statements reused across calls bind each call's own
values, and a None is SQL NULL."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from services.admission.domain import FreshnessPolicy
from services.admission.service import Admitter
from services.orchestrator.repositories.transitions import LEASE_UNTIL, NEXT_EPOCH, NOW, apply
from tests.integration.test_admission import _tenant, chat
from tether import states
from tether.db.schema import run_event_log, runs
from tether.domain import Event, EventType, run_started

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def _claim(engine: AsyncEngine, run_id: str, worker: str, ttl_s: float) -> None:
    async with engine.begin() as conn:
        moved = await apply(
            conn,
            states.CLAIM,
            run_id,
            events=[run_started(1, worker, 1)],
            values={
                "lease_owner": worker,
                "lease_epoch": NEXT_EPOCH,
                "lease_expires_at": LEASE_UNTIL,
            },
            params={"lease_ttl": timedelta(seconds=ttl_s)},
        )
    assert moved is not None and moved.run.lease_owner == worker


async def test_one_shape_binds_each_calls_values(engine: AsyncEngine) -> None:
    await _tenant(engine, "t1")
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    first = (await admitter.admit(chat("e1", conversation="c1"))).run.run_id
    second = (await admitter.admit(chat("e2", conversation="c2"))).run.run_id

    await _claim(engine, first, "w-1", 30)
    await _claim(engine, second, "w-2", 300)  # the same shape: the statement is reused

    async with engine.connect() as conn:
        rows = {
            r.run_id: r
            for r in (
                await conn.execute(
                    select(
                        runs.c.run_id,
                        runs.c.lease_owner,
                        runs.c.last_seq,
                        (runs.c.lease_expires_at - runs.c.updated_at).label("ttl"),
                    ).where(runs.c.run_id.in_([first, second]))
                )
            ).all()
        }
        started = (
            await conn.execute(
                select(run_event_log.c.run_id, run_event_log.c.seq, run_event_log.c.payload).where(
                    run_event_log.c.type == "run.started"
                )
            )
        ).all()
    assert rows[first].lease_owner == "w-1" and rows[second].lease_owner == "w-2"
    assert rows[first].ttl == timedelta(seconds=30)
    assert rows[second].ttl == timedelta(seconds=300)
    # Each run's event took the seq its own move reserved, after run.queued (seq 1).
    assert sorted((e.run_id, e.seq, e.payload["workerId"]) for e in started) == sorted(
        [(first, 2, "w-1"), (second, 2, "w-2")]
    )
    assert rows[first].last_seq == rows[second].last_seq == 2


async def test_a_none_value_is_sql_null_not_json_null(engine: AsyncEngine) -> None:
    await _tenant(engine, "t1")
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    run_id = (await admitter.admit(chat("e3", conversation="c3"))).run.run_id
    await _claim(engine, run_id, "w-1", 30)
    async with engine.begin() as conn:
        moved = await apply(
            conn,
            states.FAIL,
            run_id,
            epoch=1,
            events=[Event(EventType.RUN_FAILED, {})],
            values={"error": None, "lease_owner": None, "finished_at": NOW},
        )
    assert moved is not None
    async with engine.connect() as conn:
        null_error = (
            await conn.execute(
                select(runs.c.error.is_(None), runs.c.lease_owner.is_(None)).where(
                    runs.c.run_id == run_id
                )
            )
        ).one()
    assert tuple(null_error) == (True, True)
