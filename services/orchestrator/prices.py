"""The prices of the runs this replica leased, so pricing a model turn costs no query."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection

from tether.db.schema import runs
from tether.pricing import Price, cost_micros

# Runs finished on another replica leave entries behind; past this many the book starts over.
MAX_RUNS = 10_000


class Prices:
    """Per run, the price of each model, as routing resolved it when the run was leased."""

    def __init__(self) -> None:
        self._by_run: dict[str, dict[str, Any]] = {}

    def remember(self, run_id: str, prices: Mapping[str, Mapping[str, Any]]) -> None:
        """Keep a leased run's prices."""
        if len(self._by_run) > MAX_RUNS:
            self._by_run.clear()
        self._by_run[run_id] = {m: dict(p) for m, p in prices.items()}

    def forget(self, run_id: str) -> None:
        """Drop a finished run's prices."""
        self._by_run.pop(run_id, None)

    async def priced(
        self, conn: AsyncConnection, run_id: str, turns: Sequence[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """The turns, each with its cost."""
        if not turns:
            return []
        prices = self._by_run.get(run_id)
        if prices is None:  # leased by another replica, or before a restart
            row = (await conn.execute(select(runs.c.config).where(runs.c.run_id == run_id))).one()
            prices = dict((row.config or {}).get("prices", {}))
        out = []
        for turn in turns:
            price_row = prices.get(turn.get("model", ""))
            price = Price(**price_row) if price_row else None
            out.append({**turn, "cost_micros": cost_micros(turn, price)})
        return out
