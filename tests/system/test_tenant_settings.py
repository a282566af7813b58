"""A tenant's settings and a run's priority with the services as processes: the platform operator
sets a tenant's weight and cap (the CLI, gRPC and HTTP v2), audited; anyone else, a weight below
1, a negative cap or an absent tenant is refused with nothing written. A run's priority is named
by a key holding runs:priority only, and an unknown one is refused before anything is written."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from sqlalchemy import func, select

from tests.system.execution_support import ExecStack
from tests.system.streaming_support import prompt
from tests.system.test_operations import (
    OPERATOR,
    call,
    meta,
    refused,
    run_count,
    stack,
    stack_file,
    tether,
)
from tether import apikeys
from tether.client import run_to_dict
from tether.db.engine import create_engine
from tether.db.schema import audit_log, runs, tenants
from tether.testing.model_server import TextTurn
from tether.v1 import gateway_pb2

# a whole stack of processes per module: tens of seconds, so in `make slow` (the 15-minute budget)
pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.slow]
__all__ = ["stack"]  # the module's stack, with the operator's credential


async def settings_of(stack: ExecStack, tenant_id: str) -> tuple[Any, int]:
    """The tenant's (weight, max_running) and how many tenant.updated records it has."""
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            row = (
                await conn.execute(
                    select(tenants.c.weight, tenants.c.max_running).where(
                        tenants.c.tenant_id == tenant_id
                    )
                )
            ).one()
            audited = (
                await conn.execute(
                    select(func.count())
                    .select_from(audit_log)
                    .where(
                        audit_log.c.tenant_id == tenant_id,
                        audit_log.c.action == "tenant.updated",
                    )
                )
            ).scalar_one()
        return (row.weight, row.max_running), int(audited)
    finally:
        await engine.dispose()


async def test_the_operator_sets_a_tenants_weight_and_cap_and_no_one_else(
    stack: ExecStack, tmp_path: Path
) -> None:
    tenant = await stack.tenant()
    assert await settings_of(stack, tenant.tenant_id) == ((1, None), 0)

    code, out = await tether(
        "--stack",
        stack_file(stack, tenant, tmp_path),
        "tenant",
        "set",
        tenant.tenant_id,
        "--weight",
        "3",
        "--max-running",
        "2",
        "--json",
    )
    assert code == 0, out
    assert json.loads(out) == {"tenant_id": tenant.tenant_id, "weight": 3, "max_running": 2}
    assert await settings_of(stack, tenant.tenant_id) == ((3, 2), 1)

    async def refusal(request: gateway_pb2.SetTenantRequest, key: str) -> grpc.StatusCode:
        error = await refused(call(stack, "SetTenant", request, meta(key)))
        return error.code()

    invalid = grpc.StatusCode.INVALID_ARGUMENT
    name = tenant.tenant_id
    assert (
        await refusal(gateway_pb2.SetTenantRequest(tenant_id=name, weight=0), OPERATOR) == invalid
    )
    assert await refusal(gateway_pb2.SetTenantRequest(tenant_id=name, weight=-2), OPERATOR) == (
        invalid
    )
    negative_cap = gateway_pb2.SetTenantRequest(tenant_id=name, max_running=-1)
    assert await refusal(negative_cap, OPERATOR) == invalid
    both = gateway_pb2.SetTenantRequest(tenant_id=name, max_running=1, clear_max_running=True)
    assert await refusal(both, OPERATOR) == invalid
    assert await refusal(gateway_pb2.SetTenantRequest(tenant_id=name), OPERATOR) == invalid
    absent = gateway_pb2.SetTenantRequest(tenant_id="no-such-tenant", weight=2)
    assert await refusal(absent, OPERATOR) == grpc.StatusCode.NOT_FOUND
    # A tenant's own key, whatever its scopes, never sets its share of the pool.
    mighty = await stack.tenant(scopes=apikeys.ALL_SCOPES)
    own = gateway_pb2.SetTenantRequest(tenant_id=mighty.tenant_id, weight=100)
    assert await refusal(own, mighty.api_key) == grpc.StatusCode.PERMISSION_DENIED
    # Nothing was written by any refusal.
    assert await settings_of(stack, tenant.tenant_id) == ((3, 2), 1)
    assert await settings_of(stack, mighty.tenant_id) == ((1, None), 0)

    base = f"http://{stack.services.http_addresses()['gateway']}"
    async with aiohttp.ClientSession() as http:
        url = f"{base}/v2/tenants/{tenant.tenant_id}"
        body = {"weight": 2, "clearMaxRunning": True}
        headers = {"Authorization": f"Bearer {OPERATOR}"}
        async with http.post(url, json=body, headers=headers) as response:
            assert response.status == 200, await response.text()
            assert await response.json() == {"tenantId": tenant.tenant_id, "weight": 2}
        mine = {"Authorization": f"Bearer {mighty.api_key}"}
        async with http.post(
            f"{base}/v2/tenants/{mighty.tenant_id}", json={"weight": 9}, headers=mine
        ) as response:
            assert response.status == 403, await response.text()
        async with http.post(url, json={"maxRunning": -3}, headers=headers) as response:
            assert response.status == 400, await response.text()
            assert "max_running" in (await response.json())["error"]["message"]
    assert await settings_of(stack, tenant.tenant_id) == ((2, None), 2)
    assert await settings_of(stack, mighty.tenant_id) == ((1, None), 0)


async def test_a_runs_priority_is_named_by_a_key_holding_runs_priority_only(
    stack: ExecStack,
) -> None:
    plain = await stack.tenant()
    ask = gateway_pb2.SendMessageRequest(
        event_id="e-high", conversation_id="c", text="hi", priority="high"
    )
    denied = await refused(call(stack, "SendMessage", ask, plain.metadata))
    assert denied.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "runs:priority" in (denied.details() or "")
    unknown = gateway_pb2.SendMessageRequest(
        event_id="e-urgent", conversation_id="c", text="hi", priority="urgent"
    )
    bad = await refused(call(stack, "SendMessage", unknown, plain.metadata))
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "high, normal, low" in (bad.details() or "")
    assert await run_count(stack, plain.tenant_id) == 0

    trusted = await stack.tenant(scopes=[*apikeys.CLIENT_SCOPES, apikeys.RUNS_PRIORITY])
    sent = await call(stack, "SendMessage", ask, trusted.metadata)
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            stored = (
                await conn.execute(select(runs.c.priority).where(runs.c.run_id == sent.run.run_id))
            ).scalar_one()
    finally:
        await engine.dispose()
    assert stored == 0


async def priority_of(stack: ExecStack, run_id: str) -> int:
    """The run's stored priority (its rank: 0 high, 1 normal, 2 low)."""
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            stmt = select(runs.c.priority).where(runs.c.run_id == run_id)
            return int((await conn.execute(stmt)).scalar_one())
    finally:
        await engine.dispose()


async def test_the_cli_sends_with_a_priority_only_for_a_key_holding_runs_priority(
    stack: ExecStack, tmp_path: Path
) -> None:
    trusted = await stack.tenant(scopes=[*apikeys.CLIENT_SCOPES, apikeys.RUNS_PRIORITY])
    text = prompt("cli priority")
    stack.model.script(text, [TextTurn("ok")])
    sent = ("send", text, "--conversation", "c-priority", "--json")
    code, out = await tether(
        *sent, "--priority", "low", "--stack", stack_file(stack, trusted, tmp_path)
    )
    assert code == 0, out
    assert await priority_of(stack, json.loads(out)["run_id"]) == 2

    plain = await stack.tenant()
    plain_file = stack_file(stack, plain, tmp_path)
    code, out = await tether(*sent, "--priority", "high", "--stack", plain_file)
    assert code == 1 and "PERMISSION_DENIED" in out and "runs:priority" in out, out
    code, out = await tether(*sent, "--priority", "urgent", "--stack", plain_file)
    assert code == 2 and "invalid choice: 'urgent'" in out and "'high', 'normal', 'low'" in out, out
    assert await run_count(stack, plain.tenant_id) == 0
    # Without the flag the key needs nothing more: the run is normal.
    stack.model.script(prompt("cli no priority"), [TextTurn("ok")])
    code, out = await tether("send", prompt("cli no priority"), "--json", "--stack", plain_file)
    assert code == 0, out
    assert await priority_of(stack, json.loads(out)["run_id"]) == 1


async def running_now(stack: ExecStack, tenant_id: str) -> int:
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            stmt = (
                select(func.count())
                .select_from(runs)
                .where(runs.c.tenant_id == tenant_id, runs.c.status == "running")
            )
            return int((await conn.execute(stmt)).scalar_one())
    finally:
        await engine.dispose()


async def test_a_tenants_cap_holds_across_two_replicas_racing(stack: ExecStack) -> None:
    """Two orchestrator replicas, each with a worker of 8 slots, lease a capped tenant's 20
    runs: no sample ever sees more than 3 running, the cap is reached (it is what holds them
    back), and every run completes."""
    second = await stack.services.start("orchestrator")
    await stack.start_worker(TETHER_ORCHESTRATOR_ADDR=second.address)
    tenant = await stack.tenant()
    await call(
        stack,
        "SetTenant",
        gateway_pb2.SetTenantRequest(tenant_id=tenant.tenant_id, max_running=3),
        meta(OPERATOR),
    )
    words = [f"w{i} " for i in range(8)]
    texts = [prompt(f"capped {i}") for i in range(20)]
    for text in texts:
        stack.model.script(text, [TextTurn("".join(words), chunks=words, delay_ms=40)])
    run_ids = [await tenant.send(text) for text in texts]

    most = 0
    said: dict[str, Any] = {}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while True:
        now = await running_now(stack, tenant.tenant_id)
        most = max(most, now)
        assert now <= 3, f"{now} runs of a tenant capped at 3 running at once"
        if not said:
            # The last run waits behind the cap for most of the test: GetRun says why.
            last = (await get_run(stack, tenant, run_ids[-1])).run
            if last.HasField("waiting_for"):
                said = run_to_dict(last)
        if await completed(stack, run_ids) == len(run_ids):
            break
        assert loop.time() < deadline, "the capped tenant's runs did not all complete"
    assert most == 3
    assert said["status"] == "queued"
    assert said["waiting_for"] == {"reason": "tenant_concurrency", "cap": 3}
    done = (await get_run(stack, tenant, run_ids[-1])).run
    assert not done.HasField("waiting_for")


async def completed(stack: ExecStack, run_ids: list[str]) -> int:
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            stmt = (
                select(func.count())
                .select_from(runs)
                .where(runs.c.run_id.in_(run_ids), runs.c.status == "completed")
            )
            return int((await conn.execute(stmt)).scalar_one())
    finally:
        await engine.dispose()


async def get_run(stack: ExecStack, tenant: Any, run_id: str) -> gateway_pb2.GetRunResponse:
    request = gateway_pb2.GetRunRequest(run_id=run_id)
    response: gateway_pb2.GetRunResponse = await call(stack, "GetRun", request, tenant.metadata)
    return response
