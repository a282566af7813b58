"""An agent's cap on runs at once (`limits.max_running` in its document) with the services as
processes: two orchestrator replicas, each with a worker, race to lease a capped agent's runs and
never run more than its cap, while the same tenant's uncapped agent's runs lease past them; a
queued run held back says why (GetRun's waiting_for); a cap that is not a positive whole number
is refused at apply with nothing stored."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import pytest_asyncio
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from tests.system.execution_support import ExecStack, Tenant, exec_stack
from tests.system.streaming_support import prompt
from tests.system.test_agents_runs import AGENT_SCOPES, apply
from tests.system.test_tenant_settings import get_run
from tether.client import run_to_dict
from tether.db.engine import create_engine
from tether.db.schema import agent_versions, runs
from tether.testing.model_server import TextTurn
from tether.v1 import gateway_pb2

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.slow]

CAP = 3


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ExecStack]:
    run_dir = Path(tmp_path_factory.mktemp("agent-caps"))
    async with exec_stack(pg_server_url, template_db, redis_url, run_dir, workers=1) as running:
        yield running


async def count(conn: AsyncConnection, run_ids: list[str], status: str) -> int:
    """How many of `run_ids` are in `status` now."""
    stmt = (
        select(func.count())
        .select_from(runs)
        .where(runs.c.run_id.in_(run_ids), runs.c.status == status)
    )
    return int((await conn.execute(stmt)).scalar_one())


async def send_on(tenant: Tenant, text: str, channel: str) -> str:
    """Send `text` as the tenant on `channel`: the run's id."""
    async with grpc.aio.insecure_channel(tenant.stack.addr("gateway")) as connection:
        response = await tenant.stub(connection).SendMessage(
            gateway_pb2.SendMessageRequest(
                text=text,
                conversation_id=f"c-{uuid.uuid4().hex[:8]}",
                event_id=f"e-{uuid.uuid4().hex}",
                channel=channel,
            ),
            metadata=tenant.metadata,
        )
    return str(response.run.run_id)


async def test_an_agents_cap_holds_across_two_replicas_racing(stack: ExecStack) -> None:
    """Two orchestrator replicas, each with a worker, lease 20 runs of an agent capped at 3:
    no sample ever sees more than 3 of them running, the cap is reached (it is what holds them
    back), a queued one says so, every run completes, and the tenant's uncapped agent's runs
    sent after them complete while the capped agent's are still queued."""
    second = await stack.services.start("orchestrator")
    await stack.start_worker(TETHER_ORCHESTRATOR_ADDR=second.address)
    tenant = await stack.tenant(scopes=AGENT_SCOPES)
    await apply(tenant, {"name": "capped", "limits": {"max_running": CAP}})
    await apply(tenant, {"name": "free", "routes": [{"channel": "side"}]})

    # Each capped run streams for about 0.6 s: 20 at 3 at a time take seven rounds.
    words = [f"w{i} " for i in range(12)]
    texts = [prompt(f"agent capped {i}") for i in range(20)]
    for text in texts:
        stack.model.script(text, [TextTurn("".join(words), chunks=words, delay_ms=50)])
    capped = [await tenant.send(text) for text in texts]
    free_texts = [prompt(f"agent free {i}") for i in range(2)]
    for text in free_texts:
        stack.model.script(text, [TextTurn("free")])
    free = [await send_on(tenant, text, "side") for text in free_texts]

    most = 0
    said: dict[str, Any] = {}
    capped_done_when_free_done: int | None = None
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        async with engine.connect() as conn:
            while True:
                now = await count(conn, capped, "running")
                await conn.commit()  # each sample its own snapshot
                most = max(most, now)
                assert now <= CAP, f"{now} runs of an agent capped at {CAP} running at once"
                if not said:
                    # The last run waits behind the cap for most of the test: GetRun says why.
                    last = (await get_run(stack, tenant, capped[-1])).run
                    if last.HasField("waiting_for"):
                        said = run_to_dict(last)
                if capped_done_when_free_done is None and await count(
                    conn, free, "completed"
                ) == len(free):
                    capped_done_when_free_done = await count(conn, capped, "completed")
                done = await count(conn, capped, "completed")
                await conn.commit()
                if done == len(capped) and capped_done_when_free_done is not None:
                    break
                assert loop.time() < deadline, f"{done} of the capped agent's runs completed"
            agents = (
                await conn.execute(
                    select(runs.c.agent_name, func.count())
                    .where(runs.c.run_id.in_(capped + free))
                    .group_by(runs.c.agent_name)
                )
            ).all()
    finally:
        await engine.dispose()
    assert most == CAP
    assert said["status"] == "queued"
    assert said["waiting_for"] == {"reason": "agent_concurrency", "cap": CAP}
    assert capped_done_when_free_done is not None
    # Claims of up to 8 runs (a worker's slots) that did not pass over the capped agent's
    # queued runs would reach the uncapped agent's only once fewer than 8 of those were left.
    assert capped_done_when_free_done <= 2 * CAP, (
        f"the uncapped agent's runs waited behind the capped agent's queue: "
        f"{capped_done_when_free_done} of its runs completed first"
    )
    assert sorted(agents) == [("capped", 20), ("free", 2)]
    done_run = (await get_run(stack, tenant, capped[-1])).run
    assert not done_run.HasField("waiting_for")


@pytest.mark.parametrize("cap", [0, -1, 2.5, "3", True])
async def test_a_cap_that_is_not_a_positive_whole_number_is_refused_at_apply(
    stack: ExecStack, cap: object
) -> None:
    tenant = await stack.tenant(scopes=AGENT_SCOPES)
    base = f"http://{stack.services.http_addresses()['gateway']}"
    spec = json.dumps({"name": "bad", "limits": {"max_running": cap}})
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{base}/v2/agents",
            json={"spec": spec},
            headers={"Authorization": f"Bearer {tenant.api_key}"},
        ) as response,
    ):
        assert response.status == 400, await response.text()
        error = (await response.json())["error"]
    assert error["status"] == "INVALID_ARGUMENT"
    assert "/limits/max_running" in str(error)
    assert ("must be >= 1" if cap in (0, -1) else "must be a whole number") in str(error)
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            stored = (
                await conn.execute(
                    select(func.count())
                    .select_from(agent_versions)
                    .where(agent_versions.c.tenant_id == tenant.tenant_id)
                )
            ).scalar_one()
    finally:
        await engine.dispose()
    assert stored == 0
