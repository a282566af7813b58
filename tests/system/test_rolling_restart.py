"""A rolling restart loses nothing: every service is restarted in turn (SIGTERM, its drain, then
started again on its address, as a Deployment's rollout replaces a pod behind its Service)
while a steady stream of runs is sent and followed live. Every message makes exactly one run,
every run completes exactly once with its whole answer, and every live stream catches up: its
durable events arrive gapless and in order, and the transcript they build is the run's."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from sqlalchemy import func, select

from services.orchestrator.repositories.answers import READ_RUN
from tests.system.execution_support import ExecStack, exec_stack
from tests.system.streaming_support import transcript
from tether.client import TetherClient
from tether.db.engine import create_engine
from tether.db.schema import run_event_log, runs
from tether.testing.eventually import eventually
from tether.testing.model_server import TextTurn
from tether.transport import TERMINAL_TYPES
from tether.v1 import events_pb2

# `make slow`: every service restarted in turn under load, half a minute.
pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.slow]

# In rollout order: orchestrators first (a worker of the new release needs its Work stream),
# the public edge last. One process of each: while one is away nothing else serves its part,
# so callers' retries, reconnects and the leases' fences carry the load across the gap.
ROLLOUT = ("orchestrator", "admission", "interactions", "worker", "gateway")
# Drains sized for a test (the worker's is the stack's, 3 s): what is in flight is short.
DRAINS = {f"TETHER_{s.upper()}_GRACE_S": "1" for s in ROLLOUT if s != "worker"}
# The pace of the load: a new message every SEND_EVERY_S, each answered in a short stream.
SEND_EVERY_S = 0.25
CHUNKS = 8
# More than any run is attempted here (each restart can cut an attempt at most once).
ATTEMPTS = 4
# Runs that must finish after a restart before the next one: the new process carries load.
SETTLED = 3


@dataclass
class Followed:
    """One message: its run, and what its live stream delivered."""

    text: str
    answer: str
    event_id: str = field(default_factory=lambda: f"e-{uuid.uuid4().hex}")
    run_id: str = ""
    events: list[events_pb2.RunEvent] = field(default_factory=list)
    done: bool = False

    @property
    def durable(self) -> list[events_pb2.RunEvent]:
        return [e for e in self.events if e.seq]


@pytest_asyncio.fixture(loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path: Path
) -> AsyncIterator[ExecStack]:
    async with exec_stack(
        pg_server_url, template_db, redis_url, tmp_path, workers=1, extra_env=DRAINS
    ) as running:
        yield running


async def follow(client: TetherClient, item: Followed) -> None:
    """Send the message (retried through an outage with its event id) and follow its run to
    the end across reconnects."""
    sent = await client.send(
        item.text, conversation_id=f"c-{uuid.uuid4().hex[:8]}", event_id=item.event_id
    )
    item.run_id = sent.run.run_id
    async for response in client.watch(item.run_id):
        if response.WhichOneof("item") == "event":
            item.events.append(response.event)
    item.done = True


async def test_a_rolling_restart_of_every_service_loses_no_run_and_no_event(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant()
    client = TetherClient(stack.addr("gateway"), tenant.api_key)
    followed: list[Followed] = []
    followers: list[asyncio.Task[None]] = []
    stop = asyncio.Event()

    async def load() -> None:
        while not stop.is_set():
            n = len(followed)
            words = [f"r{n}w{i} " for i in range(CHUNKS)]
            item = Followed(f"rolling {n} {uuid.uuid4().hex}", "".join(words))
            # The same answer however often it is asked: a drain that cuts an attempt means
            # the next attempt asks again.
            turn = TextTurn(item.answer, chunks=words, delay_ms=25)
            stack.model.script(item.text, [turn] * ATTEMPTS)
            followed.append(item)
            followers.append(asyncio.create_task(follow(client, item), name=f"follow-{n}"))
            # The pace of the load, not a wait for anything.
            await asyncio.sleep(SEND_EVERY_S)

    def finished() -> int:
        return sum(1 for item in followed if item.done)

    loader = asyncio.create_task(load(), name="load")
    try:
        await eventually(_at_least(finished, SETTLED), timeout=30, what="load to flow")
        for instance in ROLLOUT:
            await stack.services.restart(instance, graceful=True, timeout=30)
            await eventually(
                _at_least(finished, finished() + SETTLED),
                timeout=30,
                what=f"runs to finish after {instance} came back",
            )
    finally:
        stop.set()
        await loader
    try:
        async with asyncio.timeout(60):
            await asyncio.gather(*followers)
    finally:
        await client.close()

    assert len(followed) >= 30, f"a steady stream: {len(followed)} messages"
    run_ids = [item.run_id for item in followed]
    assert len(set(run_ids)) == len(run_ids), "one run per message"
    rows, completions = await _outcomes(stack.db_url, tenant.tenant_id)
    assert set(rows) == set(run_ids), "and no other run"
    for item in followed:
        row = rows[item.run_id]
        assert (row.status, row.result_text) == ("completed", item.answer), item.run_id
        assert completions[item.run_id] == 1, f"{item.run_id} completed exactly once"
        # The live stream caught up: every durable event, once, in order, to the end.
        seqs = [event.seq for event in item.durable]
        assert seqs == list(range(1, row.last_seq + 1)), item.run_id
        assert item.durable[-1].type in TERMINAL_TYPES
        texts = [part["text"]["text"] for part in transcript(item.events) if "text" in part]
        assert "".join(texts) == item.answer, item.run_id


def _at_least(count: Callable[[], int], target: int) -> Callable[[], Awaitable[bool]]:
    async def probe() -> bool:
        return count() >= target

    return probe


async def _outcomes(db_url: str, tenant_id: str) -> tuple[dict[str, Any], dict[str, int]]:
    """The tenant's runs by id, and how many run.completed events each has."""
    engine = create_engine(db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            # As every reader takes a run (its answer from its parts, when they hold it).
            found = await conn.execute(select(*READ_RUN).where(runs.c.tenant_id == tenant_id))
            rows = {row.run_id: row for row in found}
            counted = await conn.execute(
                select(run_event_log.c.run_id, func.count())
                .where(run_event_log.c.run_id.in_(rows), run_event_log.c.type == "run.completed")
                .group_by(run_event_log.c.run_id)
            )
            return rows, {run_id: int(n) for run_id, n in counted}
    finally:
        await engine.dispose()
