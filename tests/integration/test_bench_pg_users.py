"""The hot-path bench's count of PostgreSQL's CPU by who asked for it, against a real server:
a pool's backend that works is counted under its pool's name, and what no live backend holds
is the rest of the server's total."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from bench.pg_users import ENDED, by_application, sample
from tether.db.engine import create_engine

pytestmark = pytest.mark.asyncio(loop_scope="session")

# About a third of a second of one backend's CPU on this machine.
BURN = "SELECT count(*) FROM generate_series(1, 3000000)"


async def test_a_pools_work_is_counted_under_its_name(db_url: str) -> None:
    engine = create_engine(db_url, pool_size=1, application="probe")
    try:
        async with engine.connect() as conn:
            await conn.execute(text("SELECT 1"))  # the backend is there before the first sample
            before = await sample(db_url)
            await conn.execute(text(BURN))
            after = await sample(db_url)
    finally:
        await engine.dispose()
    live_s = sum(seconds - before.get(pid, ("", 0.0))[1] for pid, (_, seconds) in after.items())
    # The server's total as the postmaster's tree would give it, with a second more than the
    # live processes used: a backend that ended in between.
    used = by_application(before, after, live_s + 1.0)
    # The kernel's per-process times are sampled by the tick: allow a few ticks.
    assert 0.1 <= used["tether-probe"] < 5.0, used
    assert abs(used[ENDED] - 1.0) < 0.05, used
