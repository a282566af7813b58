"""A worker frozen between counting its post and making it never posts when it wakes (issue 30's
"never twice", found by issue 33's soak under load): the services are real processes, the worker
is SIGSTOPped for real, Slack is the local stand-in.

The worker counts each provider call in the delivery record before making it, so an attempt that
takes the run over knows one may have landed and looks for it first. A worker frozen after the
count (its answer waiting in its socket) and woken after another attempt looked, found nothing
and posted, would post a second time: the count is fenced by the lease, the post is not. It now
posts only while its clock is well before the lease that count extended lapses.
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from sqlalchemy import select, text

from tests.system.delivery_support import Rig, delivery_of, delivery_rig
from tests.system.execution_support import wait_for_status
from tether.db.engine import create_engine
from tether.db.schema import deliveries
from tether.testing.eventually import eventually
from tether.testing.model_server import TextTurn
from tether.testing.slack_server import RateLimited

pytestmark = pytest.mark.slow

# The refused post's Retry-After: the time the test has to hold the delivery's row before the
# worker counts its next post.
RETRY_AFTER_S = 3


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def rig(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Rig]:
    run_dir = Path(tmp_path_factory.mktemp("delivery-stall"))
    async with delivery_rig(pg_server_url, template_db, redis_url, run_dir) as rig:
        yield rig


async def _waiting_on_a_lock(db_url: str) -> None:
    engine = create_engine(db_url, pool_size=1)
    waiting = text(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE wait_event_type = 'Lock' AND datname = current_database()"
    )
    try:
        # Each look its own transaction: PostgreSQL keeps what a transaction first saw of
        # pg_stat_activity until it ends.
        async with engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:

            async def some() -> bool | None:
                return (await conn.execute(waiting)).scalar_one() > 0 or None

            await eventually(some, timeout=RETRY_AFTER_S + 10, what="the count to wait")
    finally:
        await engine.dispose()


async def test_a_worker_frozen_after_counting_its_post_does_not_post_when_it_wakes(
    rig: Rig,
) -> None:
    tenant = await rig.stack.tenant()
    channel_id = await rig.add_channel(tenant, "slack")
    words = f"freeze me before the post {uuid.uuid4().hex}"
    rig.stack.model.script(words, [TextTurn("The one answer.")])
    rig.slack.script("chat.postMessage", RateLimited(retry_after=RETRY_AFTER_S), times=1)
    (first,) = [n for n in rig.stack.services.procs if n.startswith("worker")]
    run_id, slack_channel, ts = await rig.slack_run(tenant, channel_id, words)

    def refused(calls: Any) -> bool:
        return any(
            c.method == "chat.postMessage"
            and c.status == 429
            and c.params.get("channel") == slack_channel
            for c in calls
        )

    async with asyncio.timeout(30):
        await rig.slack.wait_until(refused)
    # The worker waits out the Retry-After, then counts its next post: hold the delivery's row
    # so that the count waits, and freeze the worker while it does.
    engine = create_engine(rig.db_url, pool_size=1)
    frozen = rig.stack.services.procs[first].process
    try:
        async with engine.connect() as conn:
            await conn.begin()
            await conn.execute(
                select(deliveries.c.delivery_id)
                .where(deliveries.c.run_id == run_id)
                .with_for_update()
            )
            await _waiting_on_a_lock(rig.db_url)
            frozen.send_signal(signal.SIGSTOP)
            await conn.commit()  # the count goes through; its answer waits in a frozen socket
        await rig.stack.start_worker()
        run = await wait_for_status(rig.db_url, run_id, "completed", "failed", timeout=60)
    finally:
        frozen.send_signal(signal.SIGCONT)
        await engine.dispose()
    assert (run.status, run.attempt) == ("completed", 2)
    log = rig.stack.services.procs[first].log_path

    async def woke() -> bool | None:
        return True if f"run {run_id}: lease lost" in log.read_text() else None

    await eventually(woke, timeout=20, what="the woken worker to find its lease gone")
    replies = [m for m in rig.slack.thread(slack_channel, ts) if m.bot_id is not None]
    assert [m.text for m in replies] == ["The one answer."], "exactly one message in the thread"
    delivery = await delivery_of(rig.db_url, run_id)
    assert (delivery.state, delivery.provider_message_id) == ("sent", replies[0].ts)
