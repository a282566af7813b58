"""The prices of the runs this replica leased, so pricing a model turn costs no query."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from sqlalchemy.ext.asyncio import AsyncConnection

from services.orchestrator.repositories import runs as runs_repo
from tether.domain import ModelTurn
from tether.pricing import Price, cost_micros

# Runs finished on another replica leave entries behind; past this many the book starts over.
MAX_RUNS = 10_000


class Prices:
    """Per run, the price of each model, as routing resolved it when the run was leased."""

    def __init__(self) -> None:
        self._by_run: dict[str, Mapping[str, Price]] = {}

    def remember(self, run_id: str, prices: Mapping[str, Price]) -> None:
        """Keep a leased run's prices."""
        if len(self._by_run) > MAX_RUNS:
            self._by_run.clear()
        self._by_run[run_id] = prices

    def forget(self, run_id: str) -> None:
        """Drop a finished run's prices."""
        self._by_run.pop(run_id, None)

    async def priced(
        self, conn: AsyncConnection, run_id: str, turns: Sequence[ModelTurn]
    ) -> list[ModelTurn]:
        """The turns, each with its cost."""
        if not turns:
            return []
        prices = self._by_run.get(run_id)
        if prices is None:  # leased by another replica, or before a restart
            prices = await runs_repo.routed_prices(conn, run_id)
        return [
            replace(turn, cost_micros=cost_micros(turn.tokens(), prices.get(turn.model)))
            for turn in turns
        ]
