"""The peers' sides of `make bench BENCH=peers`: a job queue's worker process whose one job makes
the streamed Messages call every Tether run of the bench makes (bench.model.BENCH_REQUEST, the
SDK's own client, every event consumed), and the producer that enqueues those jobs, each with
the queue's own driver on its own database of the same embedded PostgreSQL.

    python -m bench.peer_jobs pgqueuer|procrastinate worker DB_URL MODEL_URL CONCURRENCY

prints `ready` once it takes jobs. The queues are bench-only dependencies
(requirements-bench.lock, installed by `make bench`); nothing under services/ or libs/ imports
them.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import asyncpg
from anthropic import AsyncAnthropic

from bench.model import BENCH_REQUEST, streamed_call

JOB = "model_call"


@dataclass(frozen=True)
class Producer:
    """A queue's client side: `enqueue` one job, `close` when done."""

    enqueue: Callable[[], Awaitable[None]]
    close: Callable[[], Awaitable[None]]


PGQUEUER_BATCH = 4  # its worker takes at least twice the batch: 8 in flight, as a Tether worker


def _sdk(model_url: str) -> AsyncAnthropic:
    return AsyncAnthropic(base_url=model_url, api_key="bench", max_retries=0)


# -- pgqueuer --------------------------------------------------------------------------------


async def pgqueuer_install(db_url: str) -> None:
    """pgqueuer's tables in `db_url`."""
    from pgqueuer import AsyncpgDriver, Queries

    conn = await asyncpg.connect(db_url)
    try:
        await Queries(AsyncpgDriver(conn)).install()
    finally:
        await conn.close()


async def pgqueuer_worker(db_url: str, model_url: str, concurrency: int) -> None:
    from pgqueuer import AsyncpgDriver, Job, Queries, QueueManager

    sdk = _sdk(model_url)
    conn = await asyncpg.connect(db_url)
    manager = QueueManager(Queries(AsyncpgDriver(conn)))

    @manager.entrypoint(JOB)
    async def model_call(job: Job) -> None:
        await streamed_call(sdk, BENCH_REQUEST)

    print("ready", flush=True)
    await manager.run(batch_size=max(1, concurrency // 2), max_concurrent_tasks=concurrency)


async def pgqueuer_producer(db_url: str) -> Producer:
    """One enqueue per call (a job each, as a run is admitted one at a time)."""
    from pgqueuer import AsyncpgDriver, Queries

    pool = await asyncpg.create_pool(db_url, min_size=4, max_size=16)
    queries = Queries(AsyncpgDriver(pool))  # type: ignore[arg-type]

    async def enqueue() -> None:
        await queries.enqueue(JOB, None)

    return Producer(enqueue, pool.close)


PGQUEUER_LEFT = "SELECT count(*) FROM pgqueuer"


# -- procrastinate ---------------------------------------------------------------------------


def _procrastinate_app(db_url: str, model_url: str = "") -> Any:
    from procrastinate import App, PsycopgConnector

    app = App(connector=PsycopgConnector(conninfo=db_url, min_size=2, max_size=16))
    sdk = _sdk(model_url) if model_url else None

    @app.task(name=JOB)
    async def model_call() -> None:
        assert sdk is not None
        await streamed_call(sdk, BENCH_REQUEST)

    app.model_call = model_call
    return app


async def procrastinate_install(db_url: str) -> None:
    """procrastinate's tables in `db_url`."""
    app = _procrastinate_app(db_url)
    async with app.open_async():
        await app.schema_manager.apply_schema_async()


async def procrastinate_worker(db_url: str, model_url: str, concurrency: int) -> None:
    app = _procrastinate_app(db_url, model_url)
    async with app.open_async():
        print("ready", flush=True)
        await app.run_worker_async(concurrency=concurrency, wait=True, install_signal_handlers=True)


async def procrastinate_producer(db_url: str) -> Producer:
    app = _procrastinate_app(db_url)
    await app.open_async()

    async def enqueue() -> None:
        await app.model_call.defer_async()

    return Producer(enqueue, app.close_async)


PROCRASTINATE_LEFT = "SELECT count(*) FROM procrastinate_jobs WHERE status <> 'succeeded'"


def main() -> None:
    peer, role, db_url, model_url, concurrency = sys.argv[1:6]
    workers = {"pgqueuer": pgqueuer_worker, "procrastinate": procrastinate_worker}
    if role != "worker" or peer not in workers:
        sys.exit(f"usage: python -m bench.peer_jobs {'|'.join(workers)} worker DB MODEL N")
    asyncio.run(workers[peer](db_url, model_url, int(concurrency)))


if __name__ == "__main__":
    main()
