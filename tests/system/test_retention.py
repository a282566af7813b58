"""Retention with the services as processes: under a steady load with a short policy the tables
stop growing (and drain once the load stops), and a late duplicate of an event whose run expired
is answered as a duplicate and never runs again."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import pytest_asyncio
from sqlalchemy import func, select

from tests.system.execution_support import ExecStack, Tenant, exec_stack, wait_for_status
from tether.db.engine import create_engine
from tether.db.schema import (
    attempts,
    event_claims,
    messages,
    run_events,
    run_parts,
    runs,
    sessions,
    usage_turns,
)
from tether.testing.eventually import eventually
from tether.v1 import gateway_pb2, gateway_pb2_grpc

# Slow: a stack of its own for expiry and retention under load (make slow).
pytestmark = pytest.mark.slow

# The sweeps of both owners, brisk: a round at least every second, a pass that kept something
# (a run's message while its run is still there) looked at again half a second later.
SWEEPS = {
    f"TETHER_{service}_RETENTION_{name}": value
    for service in ("ORCHESTRATOR", "ADMISSION")
    for name, value in (("INTERVAL_S", "0.1"), ("POLL_S", "1"), ("REPASS_S", "0.5"))
}
# Seconds: a run goes a second after it ended, its claim's tombstone two seconds after it was
# claimed; conversations are live for a second after their last run.
SHORT = {"runs_s": 1, "tool_outputs_s": 1, "conversations_s": 1, "claims_s": 2}
TABLES = (runs, run_events, run_parts, attempts, usage_turns, messages, sessions, event_claims)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ExecStack]:
    async with exec_stack(
        pg_server_url,
        template_db,
        redis_url,
        Path(tmp_path_factory.mktemp("retention")),
        workers=1,
        extra_env=SWEEPS,
    ) as running:
        yield running


async def table_counts(stack: ExecStack) -> dict[str, int]:
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            return {
                t.name: int((await conn.execute(select(func.count()).select_from(t))).scalar_one())
                for t in TABLES
            }
    finally:
        await engine.dispose()


async def send(tenant: Tenant, event_id: str, conversation: str) -> gateway_pb2.SendMessageResponse:
    async with grpc.aio.insecure_channel(tenant.stack.addr("gateway")) as channel:
        response: gateway_pb2.SendMessageResponse = await gateway_pb2_grpc.GatewayServiceStub(
            channel
        ).SendMessage(
            gateway_pb2.SendMessageRequest(
                text="what time is it", conversation_id=conversation, event_id=event_id
            ),
            metadata=tenant.metadata,
        )
    return response


# Minutes of steady load compressed into a quarter of one.
async def test_under_a_steady_load_with_a_short_policy_the_tables_stop_growing(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant(policy={"retention": SHORT})
    baseline = await table_counts(stack)
    samples: list[dict[str, int]] = []
    sent = 0

    async def load() -> None:
        nonlocal sent
        # About six runs a second for twelve seconds, each its own conversation (a webhook's).
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 12
        while loop.time() < deadline:
            await send(tenant, f"e-{uuid.uuid4().hex}", f"c-{uuid.uuid4().hex[:8]}")
            sent += 1
            await asyncio.sleep(0.15)

    async def sample() -> None:
        while True:
            counts = await table_counts(stack)
            samples.append({k: v - baseline[k] for k, v in counts.items()})
            await asyncio.sleep(0.5)

    sampler = asyncio.ensure_future(sample())
    try:
        await load()
    finally:
        sampler.cancel()
    assert sent >= 40
    half = len(samples) // 2
    for table in baseline:
        first = max(s[table] for s in samples[:half])
        second = max(s[table] for s in samples[half:])
        # Rows live about three seconds (a run's second, the sweeps' lag, its tombstone's two):
        # far fewer than were made, and no more in the second half of the load than the first.
        assert second <= max(first * 1.5, first + 10), (table, first, second, samples)
        runs_made = sent if table != "run_events" else sent * 4
        assert second < runs_made / 2, (table, second, sent)

    async def drained() -> dict[str, int] | None:
        counts = await table_counts(stack)
        return counts if counts == baseline else None

    # With the load gone, everything it made goes: runs, their aggregate, messages, sessions,
    # claims and their tombstones.
    await eventually(drained, timeout=30, interval=0.25, what="the tables back at the baseline")


async def test_a_late_duplicate_after_expiry_is_answered_and_creates_no_run(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant(policy={"retention": {**SHORT, "claims_s": 3600}})
    event_id = f"late-{uuid.uuid4().hex}"
    first = await send(tenant, event_id, "late")
    run_id = first.run.run_id
    await wait_for_status(stack.db_url, run_id, "completed")
    async with grpc.aio.insecure_channel(stack.addr("gateway")) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)

        async def gone() -> bool:
            try:
                await stub.GetRun(
                    gateway_pb2.GetRunRequest(run_id=run_id), metadata=tenant.metadata
                )
            except grpc.aio.AioRpcError as exc:
                return exc.code() == grpc.StatusCode.NOT_FOUND
            return False

        await eventually(gone, timeout=20, what=f"run {run_id} removed under retention")
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await send(tenant, event_id, "late")
        assert late.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "retention" in (late.value.details() or "")
        listed = await stub.ListRuns(gateway_pb2.ListRunsRequest(), metadata=tenant.metadata)
        assert list(listed.runs) == []
    # The same through the HTTP bridge: the bridge's JSON error, no run.
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"http://{stack.services.http_addresses()['gateway']}/v1/messages",
            json={"event_id": event_id, "conversation_id": "late", "text": "what time is it"},
            headers={"Authorization": f"Bearer {tenant.api_key}"},
        ) as response,
    ):
        body: Any = await response.json()
    assert response.status == 412
    assert body["error"]["code"] == "event_expired"
    assert await no_runs_of(stack, tenant)


async def no_runs_of(stack: ExecStack, tenant: Tenant) -> bool:
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            stmt = (
                select(func.count()).select_from(runs).where(runs.c.tenant_id == tenant.tenant_id)
            )
            return int((await conn.execute(stmt)).scalar_one()) == 0
    finally:
        await engine.dispose()
