"""The operator's reads and acts with the services as processes: a run's execution record
(GetRunAttempts, gRPC and HTTP), retrying a run (RetryRun), listing by status and time, the
platform operator within a tenant it names, and deleting a tenant from every service. Every
refusal changes nothing, and another tenant's run is NOT_FOUND like an absent one."""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import pytest_asyncio
from sqlalchemy import func, select
from sqlalchemy import text as text_sql

from tests.conftest import drop_database
from tests.system.execution_support import ExecStack, Tenant, exec_stack, wait_for_status
from tests.system.streaming_support import key_with, prompt
from tether import apikeys, credentials
from tether.db.engine import create_engine
from tether.db.schema import (
    api_keys,
    audit_log,
    channel_connections,
    event_claims,
    grants,
    interactions,
    messages,
    runs,
    sessions,
    tenants,
    webhook_secrets,
    webhook_subscriptions,
)
from tether.db.schema import secrets as secrets_table
from tether.testing.eventually import eventually
from tether.testing.model_server import ErrorTurn, TextTurn
from tether.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, interactions_pb2

OPERATOR = "top_" + secrets.token_urlsafe(32)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ExecStack]:
    async with exec_stack(
        pg_server_url,
        template_db,
        redis_url,
        Path(tmp_path_factory.mktemp("operations")),
        workers=1,
        extra_env={
            "TETHER_GATEWAY_OPERATOR_CREDENTIAL_SHA256": credentials.verifier(OPERATOR),
            # A deleted tenant goes once no replica may trust a cached key: sooner, here.
            "TETHER_GATEWAY_KEY_CACHE_TTL_S": "1.0",
            "TETHER_GATEWAY_KEY_RECHECK_S": "0.5",
        },
    ) as running:
        yield running


def meta(key: str, tenant: str = "") -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),) + ((("tether-tenant", tenant),) if tenant else ())


async def refused(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


async def send(tenant: Tenant, text: str, *, event_id: str = "") -> str:
    async with grpc.aio.insecure_channel(tenant.stack.addr("gateway")) as channel:
        response = await gateway_pb2_grpc.GatewayServiceStub(channel).SendMessage(
            gateway_pb2.SendMessageRequest(
                text=text,
                conversation_id=f"c-{uuid.uuid4().hex[:8]}",
                event_id=event_id or f"e-{uuid.uuid4().hex}",
            ),
            metadata=tenant.metadata,
        )
    return str(response.run.run_id)


async def call(stack: ExecStack, method: str, request: Any, metadata: Any) -> Any:
    async with grpc.aio.insecure_channel(stack.addr("gateway")) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        return await getattr(stub, method)(request, metadata=metadata)


async def run_count(stack: ExecStack, tenant_id: str) -> int:
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            stmt = select(func.count()).select_from(runs).where(runs.c.tenant_id == tenant_id)
            return int((await conn.execute(stmt)).scalar_one())
    finally:
        await engine.dispose()


async def failed_then_fixed(stack: ExecStack, tenant: Tenant) -> str:
    """A run that failed for good (a deterministic refusal); the model answers its retry."""
    text = prompt("retry me")
    stack.model.script(text, [ErrorTurn(400, message="messages: bad shape"), TextTurn("fixed")])
    run_id = await send(tenant, text)
    await wait_for_status(stack.db_url, run_id, "failed")
    return run_id


# -- the execution record -----------------------------------------------------------------------


async def test_a_runs_attempts_turns_and_stages_are_read_and_hidden_as_every_run_read(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant()
    text = prompt("attempts")
    stack.model.script(text, [ErrorTurn(529), TextTurn("second time lucky")])
    run_id = await send(tenant, text)
    await wait_for_status(stack.db_url, run_id, "completed")
    record = await call(
        stack, "GetRunAttempts", gateway_pb2.GetRunAttemptsRequest(run_id=run_id), tenant.metadata
    )
    assert record.run.run_id == run_id
    assert [(a.attempt, a.outcome) for a in record.attempts] == [
        (1, "retry-pending"),
        (2, "completed"),
    ]
    assert record.attempts[0].error.code == "provider_overloaded"
    assert {"total", "attempt"} <= set(record.attempts[1].stage_ms)
    assert [t.attempt for t in record.turns] == [2]
    assert record.turns[0].usage.output_tokens > 0 and record.turns[0].usage.model
    assert [r.run_id for r in record.lineage] == [run_id]
    # Another tenant's key, and another principal of the tenant without runs:all, are told
    # exactly what an absent id is told.
    other = await stack.tenant()
    peer = await key_with(stack, tenant.tenant_id, ["runs:read"])
    absent = await refused(
        call(
            stack,
            "GetRunAttempts",
            gateway_pb2.GetRunAttemptsRequest(run_id="run_x"),
            other.metadata,
        )
    )
    for key in (other.api_key, peer):
        hidden = await refused(
            call(
                stack, "GetRunAttempts", gateway_pb2.GetRunAttemptsRequest(run_id=run_id), meta(key)
            )
        )
        assert hidden.code() == absent.code() == grpc.StatusCode.NOT_FOUND
        assert hidden.details() == (absent.details() or "").replace("run_x", run_id)
    async with aiohttp.ClientSession() as http:
        base = f"http://{stack.services.http_addresses()['gateway']}"
        headers = {"Authorization": f"Bearer {tenant.api_key}"}
        async with http.get(f"{base}/v1/runs/{run_id}/attempts", headers=headers) as response:
            body = await response.json()
        assert response.status == 200
        assert body["run"]["run_id"] == run_id
        assert [a["outcome"] for a in body["attempts"]] == ["retry-pending", "completed"]
        headers = {"Authorization": f"Bearer {other.api_key}"}
        async with http.get(f"{base}/v1/runs/{run_id}/attempts", headers=headers) as response:
            assert response.status == 404
            assert (await response.json())["error"]["status"] == "NOT_FOUND"


async def test_each_services_connections_say_whose_they_are(stack: ExecStack) -> None:
    """An operator reading pg_stat_activity (a lock wait, a long statement) sees which service
    a backend serves: each pool names itself (`tether.db.engine.application_name`)."""
    tenant = await stack.tenant()
    text = prompt("whose connection")
    stack.model.script(text, [TextTurn("mine")])
    await wait_for_status(stack.db_url, await send(tenant, text), "completed")
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            found = await conn.execute(
                text_sql(
                    "SELECT DISTINCT application_name FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            )
            names = {row[0] for row in found}
    finally:
        await engine.dispose()
    expected = {"admission", "orchestrator", "orchestrator-claims", "gateway"}
    assert {f"tether-{service}" for service in expected} <= names, names


# -- retry ---------------------------------------------------------------------------------------


async def test_retrying_a_failed_run_makes_one_new_run_with_lineage_whoever_races(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant()
    failed = await failed_then_fixed(stack, tenant)
    answers = await asyncio.gather(
        *(
            call(stack, "RetryRun", gateway_pb2.RetryRunRequest(run_id=failed), tenant.metadata)
            for _ in range(5)
        )
    )
    dispositions = sorted(a.disposition for a in answers)
    assert dispositions.count(common_pb2.DISPOSITION_RETRIED) == 1
    assert dispositions.count(common_pb2.DISPOSITION_ATTACHED) == 4
    (retry_id,) = {a.run.run_id for a in answers}
    retry = answers[0].run
    assert (retry.parent_run_id, retry.root_run_id) == (failed, failed)
    await wait_for_status(stack.db_url, retry_id, "completed")
    assert await run_count(stack, tenant.tenant_id) == 2
    record = await call(
        stack, "GetRunAttempts", gateway_pb2.GetRunAttemptsRequest(run_id=retry_id), tenant.metadata
    )
    assert [r.run_id for r in record.lineage] == [failed, retry_id]
    # Retried already: the answer is the retry, attached; nothing new.
    again = await call(
        stack, "RetryRun", gateway_pb2.RetryRunRequest(run_id=failed), tenant.metadata
    )
    assert (again.disposition, again.run.run_id) == (common_pb2.DISPOSITION_ATTACHED, retry_id)
    assert await run_count(stack, tenant.tenant_id) == 2


async def test_retrying_a_completed_active_or_hidden_run_is_refused_and_changes_nothing(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant()
    completed = await send(tenant, prompt("done"))
    await wait_for_status(stack.db_url, completed, "completed")
    parked = await send(tenant, "please publish: retries are refused while I wait")
    await wait_for_status(stack.db_url, parked, "waiting-for-approval")
    before = await run_count(stack, tenant.tenant_id)
    done = await refused(
        call(stack, "RetryRun", gateway_pb2.RetryRunRequest(run_id=completed), tenant.metadata)
    )
    assert done.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "completed" in (done.details() or "")
    active = await refused(
        call(stack, "RetryRun", gateway_pb2.RetryRunRequest(run_id=parked), tenant.metadata)
    )
    assert active.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "waiting-for-approval" in (active.details() or "")
    other = await stack.tenant()
    hidden = await refused(
        call(stack, "RetryRun", gateway_pb2.RetryRunRequest(run_id=completed), other.metadata)
    )
    assert hidden.code() == grpc.StatusCode.NOT_FOUND
    read_only = await key_with(stack, tenant.tenant_id, ["runs:read", "runs:all"])
    unscoped = await refused(
        call(stack, "RetryRun", gateway_pb2.RetryRunRequest(run_id=completed), meta(read_only))
    )
    assert unscoped.code() == grpc.StatusCode.PERMISSION_DENIED
    bad = await refused(
        call(stack, "RetryRun", gateway_pb2.RetryRunRequest(run_id="no such id!"), tenant.metadata)
    )
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await run_count(stack, tenant.tenant_id) == before


# -- listing and the operator within a tenant ---------------------------------------------------


async def test_runs_are_listed_by_status_and_creation_time(stack: ExecStack) -> None:
    tenant = await stack.tenant()
    run_id = await send(tenant, prompt("listed"))
    await wait_for_status(stack.db_url, run_id, "completed")
    listed = gateway_pb2.ListRunsRequest(statuses=[common_pb2.RUN_STATUS_COMPLETED])
    listed.created_after.FromDatetime(datetime.now(UTC) - timedelta(minutes=5))
    found = await call(stack, "ListRuns", listed, tenant.metadata)
    assert [r.run_id for r in found.runs] == [run_id]
    listed.created_after.FromDatetime(datetime.now(UTC) + timedelta(minutes=5))
    assert list((await call(stack, "ListRuns", listed, tenant.metadata)).runs) == []
    failed_only = gateway_pb2.ListRunsRequest(statuses=[common_pb2.RUN_STATUS_FAILED])
    assert list((await call(stack, "ListRuns", failed_only, tenant.metadata)).runs) == []
    async with aiohttp.ClientSession() as http:
        base = f"http://{stack.services.http_addresses()['gateway']}"
        headers = {"Authorization": f"Bearer {tenant.api_key}"}
        async with http.get(
            f"{base}/v1/runs", params={"created_after": "yesterday"}, headers=headers
        ) as response:
            assert response.status == 400
            assert "RFC 3339" in (await response.json())["error"]["message"]


async def test_the_operator_reads_and_retries_only_within_a_tenant_it_names(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant()
    failed = await failed_then_fixed(stack, tenant)
    get = gateway_pb2.GetRunRequest(run_id=failed)
    found = await call(stack, "GetRun", get, meta(OPERATOR, tenant.tenant_id))
    assert found.run.run_id == failed
    unnamed = await refused(call(stack, "GetRun", get, meta(OPERATOR)))
    assert unnamed.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "tether-tenant" in (unnamed.details() or "")
    unknown = await refused(call(stack, "GetRun", get, meta(OPERATOR, "no-such-tenant")))
    assert unknown.code() == grpc.StatusCode.NOT_FOUND
    other = await stack.tenant()
    elsewhere = await refused(call(stack, "GetRun", get, meta(OPERATOR, other.tenant_id)))
    assert elsewhere.code() == grpc.StatusCode.NOT_FOUND
    # A tenant's key never names another tenant; the operator never sends messages.
    crossing = await refused(call(stack, "GetRun", get, meta(other.api_key, tenant.tenant_id)))
    assert crossing.code() == grpc.StatusCode.PERMISSION_DENIED
    send_as_operator = gateway_pb2.SendMessageRequest(text="hi", conversation_id="c", event_id="e")
    not_a_key = await refused(
        call(stack, "SendMessage", send_as_operator, meta(OPERATOR, tenant.tenant_id))
    )
    assert not_a_key.code() == grpc.StatusCode.PERMISSION_DENIED
    # The same over HTTP: the tenant in a header.
    async with aiohttp.ClientSession() as http:
        base = f"http://{stack.services.http_addresses()['gateway']}"
        operator = {"Authorization": f"Bearer {OPERATOR}"}
        async with http.get(
            f"{base}/v1/runs", headers={**operator, "Tether-Tenant": tenant.tenant_id}
        ) as response:
            assert response.status == 200
            assert [r["run_id"] for r in (await response.json())["runs"]] == [failed]
        async with http.get(f"{base}/v1/runs", headers=operator) as response:
            assert response.status == 403
            assert "tether-tenant" in (await response.json())["error"]["message"]
    retried = await call(
        stack,
        "RetryRun",
        gateway_pb2.RetryRunRequest(run_id=failed),
        meta(OPERATOR, tenant.tenant_id),
    )
    assert retried.disposition == common_pb2.DISPOSITION_RETRIED
    # The retry is the run owner's, and the audit trail says who asked.
    assert retried.run.owner_principal_id == "tester"
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            row = (
                await conn.execute(
                    select(audit_log).where(
                        audit_log.c.action == "run.retried", audit_log.c.run_id == failed
                    )
                )
            ).one()
    finally:
        await engine.dispose()
    assert row.detail["actor"] == {"kind": "operator"}
    assert row.detail["retry_run_id"] == retried.run.run_id


# -- deleting a tenant --------------------------------------------------------------------------


async def tenant_rows(stack: ExecStack, tenant_id: str) -> dict[str, int]:
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            return {
                t.name: int(
                    (
                        await conn.execute(
                            select(func.count()).select_from(t).where(t.c.tenant_id == tenant_id)
                        )
                    ).scalar_one()
                )
                for t in (
                    tenants,
                    api_keys,
                    runs,
                    event_claims,
                    messages,
                    sessions,
                    interactions,
                    grants,
                    secrets_table,
                    channel_connections,
                    webhook_subscriptions,
                    webhook_secrets,
                    audit_log,
                )
            }
    finally:
        await engine.dispose()


async def test_the_operator_deletes_a_tenant_from_every_service_and_no_one_else(
    stack: ExecStack,
) -> None:
    with_secrets = [
        *apikeys.CLIENT_SCOPES,
        apikeys.SECRETS_WRITE,
        apikeys.CHANNELS_WRITE,
        apikeys.WEBHOOKS_WRITE,
    ]
    doomed = await stack.tenant(grant=["get_time"], scopes=with_secrets)
    kept = await stack.tenant(scopes=with_secrets)
    for owner in (doomed, kept):
        secret = gateway_pb2.AddSecretRequest(name="bot-token", value="xoxb-doomed-or-kept")
        await call(stack, "AddSecret", secret, owner.metadata)
        slack = interactions_pb2.ChannelSecrets(signing_secret="s" * 20, bot_token="b" * 20)
        channel = gateway_pb2.AddChannelRequest(kind="slack", name="support", secrets=slack)
        await call(stack, "AddChannel", channel, owner.metadata)
        # An event no run here emits: nothing is sent to the (public) address.
        hook = gateway_pb2.AddWebhookRequest(
            url="https://8.8.8.8/hook",
            events=["connection.requested"],
            secret="whsec_" + base64.b64encode(b"k" * 32).decode(),
        )
        await call(stack, "AddWebhook", hook, owner.metadata)
    done = await send(doomed, prompt("doomed"))
    parked = await send(doomed, "please publish: this tenant is going away")
    await failed_then_fixed(stack, doomed)
    mine = await send(kept, prompt("kept"))
    await wait_for_status(stack.db_url, done, "completed")
    await wait_for_status(stack.db_url, parked, "waiting-for-approval")
    await wait_for_status(stack.db_url, mine, "completed")
    kept_before = await tenant_rows(stack, kept.tenant_id)
    request = gateway_pb2.DeleteTenantRequest(tenant_id=doomed.tenant_id)
    # Only the platform operator deletes a tenant.
    not_operator = await refused(call(stack, "DeleteTenant", request, kept.metadata))
    assert not_operator.code() == grpc.StatusCode.PERMISSION_DENIED
    before = await tenant_rows(stack, doomed.tenant_id)
    assert (before["runs"], before["channel_connections"]) == (3, 1), before
    assert (before["webhook_subscriptions"], before["webhook_secrets"]) == (1, 1), before

    async def deleted() -> gateway_pb2.DeleteTenantResponse | None:
        step = await call(stack, "DeleteTenant", request, meta(OPERATOR))
        return step if step.deleted else None

    await eventually(deleted, timeout=30, interval=0.3, what="the tenant deleted")
    left = await tenant_rows(stack, doomed.tenant_id)
    # Only the record that it was deleted stays.
    assert left == {**dict.fromkeys(left, 0), "audit_log": 1}, left
    assert await tenant_rows(stack, kept.tenant_id) == kept_before
    gone = await refused(call(stack, "DeleteTenant", request, meta(OPERATOR)))
    assert gone.code() == grpc.StatusCode.NOT_FOUND
    revoked = await refused(
        call(stack, "GetRun", gateway_pb2.GetRunRequest(run_id=done), doomed.metadata)
    )
    assert revoked.code() == grpc.StatusCode.UNAUTHENTICATED
    # The other tenant's runs still work.
    assert (
        await call(stack, "GetRun", gateway_pb2.GetRunRequest(run_id=mine), kept.metadata)
    ).run.status == common_pb2.RUN_STATUS_COMPLETED


# -- the CLI ------------------------------------------------------------------------------------


def stack_file(stack: ExecStack, tenant: Tenant, directory: Path, **more: Any) -> str:
    path = directory / "stack.json"
    info = {
        "gateway": stack.addr("gateway"),
        "api_key": tenant.api_key,
        "operator_credential": OPERATOR,
        "database_url": stack.db_url,
        "redis_url": stack.services.env["TETHER_REDIS_URL"],
        "services": stack.services.addresses(),
        **more,
    }
    path.write_text(json.dumps(info))
    return str(path)


async def tether(*args: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tether.cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode() + err.decode()


async def test_the_cli_shows_attempts_retries_and_lists_by_status_and_age(
    stack: ExecStack, tmp_path: Path
) -> None:
    tenant = await stack.tenant()
    file = stack_file(stack, tenant, tmp_path)
    text = prompt("cli attempts")
    stack.model.script(text, [ErrorTurn(529), TextTurn("there")])
    run_id = await send(tenant, text)
    await wait_for_status(stack.db_url, run_id, "completed")
    code, out = await tether("run", run_id, "--attempts", "--stack", file)
    assert code == 0, out
    assert f"run {run_id} status=completed" in out
    assert "retry-pending (provider_overloaded" in out and "stages: " in out
    assert "turn 1 (attempt 2)" in out and "cost: $" in out
    code, out = await tether("run", run_id, "--attempts", "--json", "--stack", file)
    record = json.loads(out)
    assert [a["outcome"] for a in record["attempts"]] == ["retry-pending", "completed"]
    assert record["turns"][0]["attempt"] == 2 and record["status"] == "completed"

    failed = await failed_then_fixed(stack, tenant)
    code, out = await tether("retry", failed, "--stack", file)
    assert code == 0 and f"run {failed} retried as run_" in out, out
    retry_id = out.split("retried as ")[1].split()[0]
    code, out = await tether("retry", failed, "--stack", file)
    assert code == 0 and f"was retried already as {retry_id}" in out, out
    code, out = await tether("retry", run_id, "--stack", file)
    assert code == 1 and "error: FAILED_PRECONDITION: " in out and "completed" in out, out
    await wait_for_status(stack.db_url, retry_id, "completed")

    code, out = await tether(
        "runs", "--status", "failed", "--since", "10m", "--json", "--stack", file
    )
    assert code == 0, out
    assert [json.loads(line)["run_id"] for line in out.splitlines()] == [failed]
    code, out = await tether("runs", "--status", "completed", "--since", "1d", "--stack", file)
    assert {line.split()[0] for line in out.splitlines()} == {run_id, retry_id}
    code, out = await tether("runs", "--since", "2099-01-01T00:00:00Z", "--stack", file)
    assert code == 0 and out == ""
    code, out = await tether("runs", "--since", "last tuesday", "--stack", file)
    assert code == 1 and "--since takes a time" in out, out

    # The platform operator, within the tenant it names.
    code, out = await tether("runs", "--tenant", tenant.tenant_id, "--json", "--stack", file)
    assert code == 0, out
    assert {json.loads(line)["run_id"] for line in out.splitlines()} == {run_id, failed, retry_id}
    code, out = await tether("run", run_id, "--tenant", "nobody-here", "--stack", file)
    assert code == 1 and "NOT_FOUND" in out, out


async def test_the_cli_deletes_a_tenant(stack: ExecStack, tmp_path: Path) -> None:
    doomed = await stack.tenant()
    run_id = await send(doomed, prompt("cli delete"))
    await wait_for_status(stack.db_url, run_id, "completed")
    file = stack_file(stack, doomed, tmp_path)
    code, out = await tether("tenant", "delete", doomed.tenant_id, "--stack", file)
    assert code == 0, out
    assert f"tenant {doomed.tenant_id} deleted: " in out and "1 runs" in out, out
    code, out = await tether("tenant", "delete", doomed.tenant_id, "--stack", file)
    assert code == 1 and "NOT_FOUND" in out, out


@pytest.mark.slow  # every migration from an empty database, and doctor against each service
async def test_doctor_checks_everything_and_migrate_brings_a_database_to_head(
    stack: ExecStack, tmp_path: Path, pg_server_url: str
) -> None:
    tenant = await stack.tenant()
    file = stack_file(stack, tenant, tmp_path)
    code, out = await tether("doctor", "--stack", file)
    assert code == 0, out
    lines = out.splitlines()
    for check in ("database", "migrations", "clock skew", "redis", "service gateway"):
        assert any(line.startswith("ok") and check in line for line in lines), (check, out)
    assert sum("service " in line for line in lines) == len(stack.services.addresses())
    code, out = await tether("doctor", "--stack", file, "--service", "ghost=127.0.0.1:9")
    assert code == 1 and any(
        line.startswith("FAIL") and "service ghost" in line for line in out.splitlines()
    ), out

    import asyncpg

    from tether.stack.embedded import database_url

    admin = await asyncpg.connect(pg_server_url)
    await admin.execute('CREATE DATABASE "tether_cli_migrate"')
    await admin.close()
    empty = database_url(pg_server_url, "tether_cli_migrate")
    try:
        behind = stack_file(stack, tenant, tmp_path, database_url=empty)
        code, out = await tether("doctor", "--stack", behind, "--json")
        checks = {json.loads(line)["check"]: json.loads(line) for line in out.splitlines()}
        assert code == 1 and not checks["migrations"]["ok"], out
        assert "tether migrate" in checks["migrations"]["detail"]
        code, out = await tether("migrate", "--database-url", empty)
        assert code == 0 and "migrated from empty to " in out, out
        code, out = await tether("migrate", "--database-url", empty)
        assert code == 0 and "nothing to apply" in out, out
        code, out = await tether("doctor", "--stack", behind)
        assert code == 0, out
    finally:
        await drop_database(pg_server_url, "tether_cli_migrate")
