"""The gateway's sweep of expired browser credentials, against the real PostgreSQL: a round
removes the expired ones (a batch at a time, the soonest expired first) and says when the next
one expires; a credential minted here that expires before that wakes it."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from services.gateway import browser_credentials as credentials
from tests.integration.test_admission import _tenant
from tether import apikeys
from tether.db.schema import browser_credentials

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def _left(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int(
            (await conn.execute(select(func.count()).select_from(browser_credentials))).scalar_one()
        )


async def test_a_sweep_removes_the_expired_credentials_and_says_when_the_next_expires(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "t1")
    async with engine.begin() as conn:
        _, key = await apikeys.create_key(conn, "t1", "alice", apikeys.CLIENT_SCOPES)
        for ttl in (600, 600, 600, 3600):
            await credentials.mint(conn, "token", key, key.scopes, ttl)
        # The three shorter ones expired five seconds ago.
        await conn.execute(
            update(browser_credentials)
            .where(browser_credentials.c.expires_at < func.now() + timedelta(minutes=20))
            .values(expires_at=func.now() - timedelta(seconds=5))
        )
    assert await _left(engine) == 4
    async with engine.begin() as conn:
        assert await credentials.sweep(conn, 2) == (2, 0.0), "more expired than the batch"
        removed, next_in = await credentials.sweep(conn, 2)
    assert removed == 1 and next_in is not None and 3590 < next_in <= 3600
    assert await _left(engine) == 1
    async with engine.begin() as conn:
        await conn.execute(update(browser_credentials).values(expires_at=func.now()))
        assert await credentials.sweep(conn, 2) == (1, None), "nothing left"


async def test_a_round_sleeps_until_the_next_expiry_and_a_sooner_mint_wakes_it(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "t1")
    sweep = credentials.Sweep(engine)
    assert await sweep.round() is None
    sweep.minted(60.0)
    assert sweep.nudge.is_set(), "the round knew of no expiry"
    sweep.nudge.clear()
    async with engine.begin() as conn:
        _, key = await apikeys.create_key(conn, "t1", "alice", apikeys.CLIENT_SCOPES)
        await credentials.mint(conn, "token", key, key.scopes, 600)
    next_in = await sweep.round()
    assert next_in is not None and 590 < next_in <= 600
    sweep.minted(900.0)
    assert not sweep.nudge.is_set(), "one expiring later waits for the round"
    sweep.minted(30.0)
    assert sweep.nudge.is_set(), "one expiring sooner wakes it"
