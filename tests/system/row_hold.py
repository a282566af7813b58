"""A run row locked by the test, so racing writes to it queue in a known order."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tether.db.engine import create_engine
from tether.db.schema import runs
from tether.testing.eventually import eventually

# What a worker's checkpoint looks like in pg_stat_activity while it waits on the row.
CHECKPOINT = "WITH fence AS"


class RowHold:
    """The run row locked by an open transaction: updates of it queue, in arrival order."""

    def __init__(self, db_url: str, run_id: str, *, take: bool = True) -> None:
        self._engine: AsyncEngine = create_engine(db_url, pool_size=2)
        self._run_id = run_id
        self._take_on_enter = take
        self._conn: AsyncConnection | None = None

    async def __aenter__(self) -> RowHold:
        if self._take_on_enter:
            await self.take()
        return self

    async def take(self) -> None:
        """Lock the row (waiting, in line, while another transaction holds it)."""
        self._conn = await self._engine.connect()
        await self._conn.begin()
        # FOR NO KEY UPDATE: every UPDATE of the row waits, foreign-key checks (an
        # interaction or a part inserted for the run) do not.
        await self._conn.execute(
            select(runs.c.run_id)
            .where(runs.c.run_id == self._run_id)
            .with_for_update(key_share=True)
        )

    async def __aexit__(self, *exc: object) -> None:
        await self.release()
        await self._engine.dispose()

    async def release(self) -> None:
        if self._conn is not None:
            await self._conn.commit()
            await self._conn.close()
            self._conn = None

    async def queue(self) -> list[str]:
        """The statements waiting for a lock in this database, oldest first."""
        async with self._engine.connect() as conn:
            rows = await conn.execute(
                text(
                    "SELECT query FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
                    " ORDER BY query_start"
                )
            )
            return [r.query for r in rows]

    async def lined_up(self, *markers: str, timeout: float = 20.0) -> None:
        """Wait until exactly these statements (by marker, in this order) wait on the row."""

        async def probe() -> bool | None:
            queued = [q for q in await self.queue() if any(m in q for m in markers)]
            if len(queued) > len(markers):
                raise AssertionError(f"more racers than expected: {queued}")
            if len(queued) < len(markers):
                return None
            order = [next(m for m in markers if m in q) for q in queued]
            assert order == list(markers), f"the racers lined up as {order}"
            return True

        try:
            await eventually(probe, timeout=timeout, interval=0.02, what=f"{markers} to line up")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; statements now: {await self.activity()}") from None

    async def activity(self) -> list[tuple[Any, ...]]:
        """What every other session of this database is doing (for a failure's message)."""
        async with self._engine.connect() as conn:
            rows = await conn.execute(
                text(
                    "SELECT state, wait_event_type, left(query, 120) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            )
            return [tuple(r) for r in rows]
