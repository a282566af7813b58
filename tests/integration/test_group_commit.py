"""Group commit against the real PostgreSQL: completions and checkpoints that arrive while the
replica's writer is busy land together in its next transaction (one commit), a stale one among
them failing alone; a write that fails a statement fails alone too; and a lone completion is
written at once, never held for a timer.

Each race is set up by synchronisation: the writer is held on a run row the test locks, the
others are seen waiting in the committer's line, then the lock is let go."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from sqlalchemy import String, bindparam, event, func, select, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.admission.domain import FreshnessPolicy
from services.admission.service import Admitter
from services.orchestrator.attempts import Attempts
from services.orchestrator.claims import Claimed
from services.orchestrator.execution import Execution
from services.orchestrator.prices import Prices
from services.orchestrator.repositories import completion, progress
from tests.integration.test_admission import _tenant, chat
from tether.db.committer import Committer, Prepared
from tether.db.direct import Direct
from tether.db.schema import runs
from tether.domain import Batch, Completed, Completion, ModelTurn, Part, Role, Text
from tether.errors import StaleLease
from tether.testing.eventually import eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")


def _answer(text_: str = "done") -> Completion:
    return Completion(
        Completed(text_),
        parts=[Part(0, Role.ASSISTANT, Text(text_), final=True)],
        turns=[ModelTurn("claude-sonnet-5-5", 10, 5)],
    )


async def _leased(engine: AsyncEngine, count: int) -> tuple[Execution, list[Claimed]]:
    await _tenant(engine, "t1")
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    for i in range(count):
        await admitter.admit(chat(f"e{i}", conversation=f"c{i}"))
    execution = Execution.build(engine, None, lease_ttl_s=30, claim_poll_s=60)
    claimed = await execution.claims.claim_many("w", count)
    assert len(claimed) == count
    return execution, claimed


def _one_writer(engine: AsyncEngine, execution: Execution) -> Attempts:
    """The lease's writes through a committer with one writer: while it is busy, every other
    write waits in line for its next transaction."""
    return Attempts(engine, execution.publisher, Prices(), lease_ttl_s=30, writers=1)


@asynccontextmanager
async def _held(engine: AsyncEngine, run_id: str) -> AsyncIterator[None]:
    """Run `run_id`'s row locked by an open transaction: a write of it waits until the end."""
    async with engine.connect() as conn, conn.begin():
        await conn.execute(
            select(runs.c.run_id).where(runs.c.run_id == run_id).with_for_update(key_share=True)
        )
        yield


async def _waits_on_a_lock(engine: AsyncEngine) -> bool | None:
    async with engine.connect() as conn:
        waiting = (
            await conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock'"
                )
            )
        ).scalar_one()
    return True if waiting else None


async def _xmins(engine: AsyncEngine, run_ids: list[str]) -> dict[str, str]:
    """The transaction that last wrote each run's row."""
    async with engine.connect() as conn:
        rows = await conn.execute(
            select(runs.c.run_id, text("runs.xmin::text AS xmin")).where(runs.c.run_id.in_(run_ids))
        )
        return {r.run_id: r.xmin for r in rows}


async def _start_behind_a_busy_writer(
    engine: AsyncEngine, attempts: Attempts, blocker: Claimed, writes: list[Any]
) -> tuple[asyncio.Task[Any], list[asyncio.Task[Any]]]:
    """Hold the writer on `blocker`'s completion, then line up `writes` behind it."""
    first = asyncio.create_task(attempts.complete(blocker.run.run_id, 1, _answer()))
    await eventually(lambda: _waits_on_a_lock(engine), what="the writer to wait on the row")
    lined = [asyncio.create_task(write) for write in writes]

    async def in_line() -> bool | None:
        return True if attempts.committer.waiting == len(writes) else None

    await eventually(in_line, what=f"{len(writes)} writes in line")
    return first, lined


async def test_writes_that_arrive_together_land_in_one_transaction_a_stale_one_alone(
    engine: AsyncEngine,
) -> None:
    execution, claimed = await _leased(engine, 6)
    attempts = _one_writer(engine, execution)
    blocker, *together, stale, checkpointed = claimed
    draft = Batch(1, [Part(0, Role.ASSISTANT, Text("so far"), final=False)])
    writes = [
        *[attempts.complete(c.run.run_id, 1, _answer()) for c in together],
        attempts.complete(stale.run.run_id, 2, _answer()),  # a lease it never held
        attempts.checkpoint(checkpointed.run.run_id, 1, draft),
    ]
    async with _held(engine, blocker.run.run_id):
        first, lined = await _start_behind_a_busy_writer(engine, attempts, blocker, writes)
    assert (await first).status == "completed"
    *completed, refused, checkpoint = await asyncio.gather(*lined, return_exceptions=True)
    assert [row.status for row in completed] == ["completed"] * len(together)
    assert isinstance(refused, StaleLease)
    assert checkpoint.last_seq == 2 and checkpoint.cancel_requested_at is None

    landed = [c.run.run_id for c in (*together, checkpointed)]
    xmins = await _xmins(engine, [blocker.run.run_id, stale.run.run_id, *landed])
    assert len({xmins[run_id] for run_id in landed}) == 1, "one transaction wrote them all"
    assert xmins[blocker.run.run_id] != xmins[landed[0]], "the first was written alone"
    async with engine.connect() as conn:
        status = (
            await conn.execute(select(runs.c.status).where(runs.c.run_id == stale.run.run_id))
        ).scalar_one()
    assert status == "running", "the stale completion wrote nothing"


async def test_a_write_whose_statement_fails_fails_alone(engine: AsyncEngine) -> None:
    execution, claimed = await _leased(engine, 4)
    attempts = _one_writer(engine, execution)
    blocker, first_ok, broken, second_ok = claimed
    # Two parts at one index: the statement that writes them is refused by PostgreSQL.
    twice = Part(0, Role.ASSISTANT, Text("twice"), final=True)
    bad = Completion(Completed("twice"), parts=[twice, twice])
    writes = [
        attempts.complete(first_ok.run.run_id, 1, _answer()),
        attempts.complete(broken.run.run_id, 1, bad),
        attempts.complete(second_ok.run.run_id, 1, _answer()),
    ]
    async with _held(engine, blocker.run.run_id):
        first, lined = await _start_behind_a_busy_writer(engine, attempts, blocker, writes)
    await first
    ok_1, failed, ok_2 = await asyncio.gather(*lined, return_exceptions=True)
    assert isinstance(failed, Exception) and not isinstance(failed, StaleLease)
    assert ok_1.status == ok_2.status == "completed"
    async with engine.connect() as conn:
        status = (
            await conn.execute(select(runs.c.status).where(runs.c.run_id == broken.run.run_id))
        ).scalar_one()
    assert status == "running", "the failed completion wrote nothing"


@pytest.mark.timeout(30)
async def test_a_lone_completion_is_written_at_once_never_held_for_a_timer(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the event loop's clock stopped no timer ever fires: a committer that waited for
    company, or for a delay, would never write. No other request arrives meanwhile."""
    execution, [claimed] = await _leased(engine, 1)
    loop = asyncio.get_running_loop()
    stopped = loop.time()
    monkeypatch.setattr(loop, "time", lambda: stopped)
    try:
        row = await execution.attempts.complete(claimed.run.run_id, 1, _answer())
    finally:
        monkeypatch.undo()
    assert row.status == "completed"
    async with engine.connect() as conn:
        status = (
            await conn.execute(select(runs.c.status).where(runs.c.run_id == claimed.run.run_id))
        ).scalar_one()
    assert status == "completed", "committed, as seen from another connection"


async def test_writes_arriving_in_one_turn_take_one_connection_and_one_transaction(
    engine: AsyncEngine,
) -> None:
    # Each write that finds a writer free starts one; the first to run takes the whole line,
    # and the others find it empty. They must then stop, not write an empty group: each
    # empty one cost a pooled connection and a BEGIN and COMMIT of nothing (192 of them in
    # 600 saturated runs once the group's BEGIN went out first).
    committer = Committer(engine, writers=4)
    checkouts: list[object] = []

    def checked_out(*_: Any) -> None:
        checkouts.append(None)

    def write(key: str) -> Any:
        async def prepare(_: AsyncConnection) -> Prepared[int]:
            return Prepared({"k": key}, lambda row: int(row.xid) if row is not None else -1)

        return committer.write_statement(key, _TRANSACTION, prepare, matched_by="k")

    event.listen(engine.sync_engine.pool, "checkout", checked_out)
    try:
        written = await asyncio.gather(*(write(f"run-{i}") for i in range(3)))
    finally:
        event.remove(engine.sync_engine.pool, "checkout", checked_out)
    assert len(set(written)) == 1, "one transaction for the three"
    assert len(checkouts) == 1


# A write that says which transaction wrote it, named by its key.
_TRANSACTION = Direct(
    select(bindparam("k", type_=String).label("k"), func.txid_current().label("xid"))
)


@asynccontextmanager
async def round_trips(engine: AsyncEngine) -> AsyncIterator[list[tuple[int, str, Any]]]:
    """What each checkout of a connection inside the block sends the server, one entry per
    round trip, as (checkout, SQL, arguments): asyncpg logs a statement, a BEGIN or a COMMIT, or
    a pipelined group (its arguments a list, one per execution), once each."""
    sent: list[tuple[int, str, Any]] = []
    logging: dict[int, Any] = {}

    def log_to(dbapi: Any, *_: Any) -> None:
        driver, checkout = dbapi.driver_connection, len(logging)

        def logger(query: Any) -> None:
            sent.append((checkout, query.query, query.args))

        logging[checkout] = (driver, logger)
        driver.add_query_logger(logger)

    def unlog(dbapi: Any, *_: Any) -> None:
        for driver, logger in logging.values():
            if driver is dbapi.driver_connection:
                driver.remove_query_logger(logger)  # a logger removed already is let be

    event.listen(engine.sync_engine.pool, "checkout", log_to)
    event.listen(engine.sync_engine.pool, "checkin", unlog)
    try:
        yield sent
    finally:
        event.remove(engine.sync_engine.pool, "checkout", log_to)
        event.remove(engine.sync_engine.pool, "checkin", unlog)


async def test_completions_that_arrive_together_are_one_round_trip_and_one_transaction(
    engine: AsyncEngine,
) -> None:
    # A group of completions only is one statement run for each: sent together (one Sync), it
    # is one transaction with no BEGIN or COMMIT, and each completion reads its own row back,
    # whether its run completed, its lease was stale (no row) or a cancel came first (a row
    # with no run, after which the run ends cancelled on its own).
    execution, claimed = await _leased(engine, 5)
    attempts = _one_writer(engine, execution)
    blocker, *together, stale, cancelled = claimed
    async with engine.begin() as conn:
        await conn.execute(
            runs.update()
            .where(runs.c.run_id == cancelled.run.run_id)
            .values(cancel_requested_at=text("now()"))
        )
    writes = [
        *[attempts.complete(c.run.run_id, 1, _answer()) for c in together],
        attempts.complete(stale.run.run_id, 2, _answer()),  # a lease it never held
        attempts.complete(cancelled.run.run_id, 1, _answer()),
    ]
    async with round_trips(engine) as sent:
        async with _held(engine, blocker.run.run_id):
            first, lined = await _start_behind_a_busy_writer(engine, attempts, blocker, writes)
        assert (await first).status == "completed"
        *completed, refused, cancel_won = await asyncio.gather(*lined, return_exceptions=True)
    assert [row.status for row in completed] == ["completed"] * len(together)
    assert isinstance(refused, StaleLease)
    assert cancel_won.status == "cancelled"

    assert pipelined(engine, sent, completion.COMPLETE) == len(writes), "in one round trip"

    landed = [c.run.run_id for c in together]
    xmins = await _xmins(engine, [stale.run.run_id, *landed])
    assert len({xmins[run_id] for run_id in landed}) == 1, "one transaction wrote them all"
    async with engine.connect() as conn:
        status = (
            await conn.execute(select(runs.c.status).where(runs.c.run_id == stale.run.run_id))
        ).scalar_one()
    assert status == "running", "the stale completion wrote nothing"


async def test_checkpoints_that_arrive_together_are_one_round_trip_and_one_transaction(
    engine: AsyncEngine,
) -> None:
    execution, claimed = await _leased(engine, 4)
    attempts = _one_writer(engine, execution)
    blocker, *together, stale = claimed
    draft = Batch(1, [Part(0, Role.ASSISTANT, Text("so far"), final=False)])
    writes = [
        *[attempts.checkpoint(c.run.run_id, 1, draft) for c in together],
        attempts.checkpoint(stale.run.run_id, 2, draft),  # a lease it never held
    ]
    async with round_trips(engine) as sent:
        async with _held(engine, blocker.run.run_id):
            first, lined = await _start_behind_a_busy_writer(engine, attempts, blocker, writes)
        await first
        *checkpointed, refused = await asyncio.gather(*lined, return_exceptions=True)
    assert [row.last_seq for row in checkpointed] == [2] * len(together)
    assert isinstance(refused, StaleLease)

    assert pipelined(engine, sent, progress.CHECKPOINT) == len(writes), "in one round trip"
    landed = [c.run.run_id for c in together]
    xmins = await _xmins(engine, [stale.run.run_id, *landed])
    assert len({xmins[run_id] for run_id in landed}) == 1, "one transaction wrote them all"
    assert xmins[stale.run.run_id] not in {xmins[run_id] for run_id in landed}


def pipelined(engine: AsyncEngine, sent: list[tuple[int, str, Any]], statement: Direct) -> int:
    """How many runs of `statement` the one checkout that sent it pipelined (`round_trips`:
    its arguments a list, one per run) sent in that round trip; that checkout sent no BEGIN or
    COMMIT."""
    sql, _ = statement.bound(engine.dialect, dict.fromkeys(statement.statement.compile().binds))
    [(checkout, runs_sent)] = [(c, a) for c, s, a in sent if s == sql and isinstance(a, list)]
    commands = {s.split()[0].rstrip(";") for c, s, _ in sent if c == checkout}
    assert not {"BEGIN", "COMMIT"} & commands, commands
    return len(runs_sent)
