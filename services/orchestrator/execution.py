"""The orchestrator's execution rooms, wired once per replica. Each room has one job:

| room | job |
|---|---|
| `claims.py` | lease the next run to a worker, with routing and history |
| `attempts.py` | what a worker writes under its lease, and how an attempt ends |
| `pauses.py` | park a run for a person; resume or expire it by its bound interaction |
| `recovery.py` | retries with backoff, due retries, the reaper of dead workers |
| `timers.py` | park a run on its `wait_until` timer; wake it once when due |
| `children.py` | start a `delegate` call's child run; park its parent; wake it when all ended |
| `deliveries.py` | a channel run's answer going out, recorded before it is sent |
| `cancellation.py` | a cancel that wins the race against a worker's move |
| `publisher.py` | committed events and wake-ups out to Redis |
| `prices.py` | the prices of leased runs, for pricing model turns |
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from services.orchestrator.attempts import Attempts
from services.orchestrator.children import Children
from services.orchestrator.claims import Claims
from services.orchestrator.deliveries import Deliveries
from services.orchestrator.pauses import Pauses
from services.orchestrator.prices import Prices
from services.orchestrator.publisher import Publisher
from services.orchestrator.recovery import Recovery
from services.orchestrator.repositories.history import HISTORY_RUNS
from services.orchestrator.timers import Timers
from tether import formats
from tether.bus import Bus


@dataclass(frozen=True)
class Execution:
    """The rooms that move runs under (or between) leases, sharing one publisher and price book."""

    engine: AsyncEngine
    publisher: Publisher
    claims: Claims
    attempts: Attempts
    pauses: Pauses
    recovery: Recovery
    deliveries: Deliveries
    timers: Timers
    children: Children

    @classmethod
    def build(
        cls,
        engine: AsyncEngine,
        bus: Bus | None,
        *,
        lease_ttl_s: float,
        claim_poll_s: float,
        claim_poll_hinted_s: float | None = None,
        history_runs: int = HISTORY_RUNS,
        claim_engine: AsyncEngine | None = None,
        stored_format: int = formats.NEWEST,
    ) -> Execution:
        """The rooms over one engine and bus (and the claims over `claim_engine`, if given: a
        pool of their own, planned with `claim_planner.CLAIM_PLANNER`); the lease's writes are
        stored in `stored_format` (see `OrchestratorSettings.stored_format`)."""
        publisher = Publisher(bus)
        prices = Prices()
        attempts = Attempts(
            engine,
            publisher,
            prices,
            lease_ttl_s=lease_ttl_s,
            stored_format=stored_format,
        )
        return cls(
            engine,
            publisher,
            Claims(
                engine,
                publisher,
                prices,
                lease_ttl_s=lease_ttl_s,
                claim_poll_s=claim_poll_s,
                claim_poll_hinted_s=claim_poll_hinted_s or claim_poll_s,
                history_runs=history_runs,
                claim_engine=claim_engine,
            ),
            attempts,
            Pauses(engine, publisher),
            Recovery(engine, publisher),
            Deliveries(engine, publisher, lease_ttl_s=lease_ttl_s),
            Timers(engine, publisher),
            Children(engine, publisher, bus, write_batch=attempts.write_batch),
        )
