"""Who may do what, against the real processes: keys stay in their tenant and scopes, the
operator alone crosses tenants, revoked and expired keys stop (streams included), every internal
service is limited to its own RPCs by its own credential, and the acts are audited."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from sqlalchemy import select

from tests.system.conftest import RunningStack
from tether import apikeys
from tether.client import TetherClient
from tether.credentials import CREDENTIAL_KEY
from tether.db.engine import create_engine
from tether.db.schema import audit_log
from tether.runtime.rpc import internal_channel
from tether.testing.eventually import eventually
from tether.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    interactions_pb2,
    interactions_pb2_grpc,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
)

T = TypeVar("T")
# The promise under test: a revoked key stops working within this, on every replica.
REVOCATION_S = 5.0
# What a loaded two-core machine may add to delivering the refusal (scheduling, not waiting).
SLACK_S = 1.0
CLI = (sys.executable, "-m", "tether.cli")


def uid() -> str:
    return uuid.uuid4().hex[:10]


async def refused(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


async def tenant_admin(stack: RunningStack, tenant_id: str = "tenant-a") -> str:
    """A key of `tenant_id` that manages keys, holding the client scopes too."""
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.begin() as conn:
            scopes = [*apikeys.CLIENT_SCOPES, apikeys.KEYS_ADMIN]
            key, _ = await apikeys.create_key(conn, tenant_id, f"admin-{uid()}", scopes)
    finally:
        await engine.dispose()
    return key


async def create_key(
    stub: gateway_pb2_grpc.GatewayServiceStub, as_key: str, **fields: Any
) -> gateway_pb2.CreateApiKeyResponse:
    response: gateway_pb2.CreateApiKeyResponse = await stub.CreateApiKey(
        gateway_pb2.CreateApiKeyRequest(**fields), metadata=(("authorization", f"Bearer {as_key}"),)
    )
    return response


def meta(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


async def audit_rows(stack: RunningStack, action: str, key_id: str) -> list[Any]:
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            rows = (await conn.execute(select(audit_log).where(audit_log.c.action == action))).all()
    finally:
        await engine.dispose()
    return [row for row in rows if row.detail.get("key_id") == key_id]


# -- keys stay in their tenant ------------------------------------------------------------------


async def test_a_tenant_key_creates_keys_only_in_its_tenant_and_never_wider(
    stack: RunningStack, gateway_channel: grpc.aio.Channel
) -> None:
    stub = gateway_pb2_grpc.GatewayServiceStub(gateway_channel)
    # The "ops" key holds every scope a key can hold, and it is still a tenant's key.
    foreign = await refused(
        create_key(stub, stack.admin_key, tenant_id="tenant-b", principal_id="mallory")
    )
    assert foreign.code() == grpc.StatusCode.PERMISSION_DENIED
    admin = await tenant_admin(stack)
    existing = await refused(create_key(stub, admin, tenant_id="tenant-b", principal_id="m"))
    absent = await refused(create_key(stub, admin, tenant_id=f"none-{uid()}", principal_id="m"))
    assert existing.code() == absent.code() == grpc.StatusCode.PERMISSION_DENIED
    assert existing.details() == absent.details(), "whether a tenant exists stays hidden"
    reader = await create_key(stub, admin, principal_id="reader", scopes=["runs:read"])
    assert (reader.tenant_id, list(reader.scopes)) == ("tenant-a", ["runs:read"])
    wider = await refused(create_key(stub, reader.api_key, principal_id="x", scopes=["runs:write"]))
    assert wider.code() == grpc.StatusCode.PERMISSION_DENIED  # no keys:admin at all
    narrow = await create_key(
        stub, await tenant_admin(stack), principal_id="n", scopes=["runs:read", "keys:admin"]
    )
    escalate = await refused(
        create_key(stub, narrow.api_key, principal_id="x", scopes=["runs:read", "runs:write"])
    )
    assert escalate.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "runs:write" in (escalate.details() or "")


async def test_no_key_is_issued_to_a_channel_connections_principal(
    stack: RunningStack, gateway_channel: grpc.aio.Channel
) -> None:
    # A channel connection's runs and conversations belong to `channel:<channel_id>`: a key
    # issued to that principal would read them and continue its threads as if it were the
    # verified connection.
    stub = gateway_pb2_grpc.GatewayServiceStub(gateway_channel)
    admin = await tenant_admin(stack)
    for principal_id in ("channel:ch_1", "channel:anything"):
        error = await refused(create_key(stub, admin, principal_id=principal_id))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "channel" in (error.details() or "")
    assert (await create_key(stub, admin, principal_id="channels-bot")).principal_id


async def test_the_operator_creates_a_tenant_and_a_key_there_and_nothing_else(
    stack: RunningStack, gateway_channel: grpc.aio.Channel
) -> None:
    stub = gateway_pb2_grpc.GatewayServiceStub(gateway_channel)
    tenant = f"new-{uid()}"
    created = await create_key(
        stub, stack.operator_credential, tenant_id=tenant, principal_id="founder"
    )
    assert created.tenant_id == tenant
    sent = await stub.SendMessage(
        gateway_pb2.SendMessageRequest(text="hi", conversation_id="c", event_id=uid()),
        metadata=meta(created.api_key),
    )
    assert sent.run.tenant_id == tenant
    not_a_tenant = await refused(
        stub.ListRuns(gateway_pb2.ListRunsRequest(), metadata=meta(stack.operator_credential))
    )
    assert not_a_tenant.code() == grpc.StatusCode.PERMISSION_DENIED
    (row,) = await audit_rows(stack, "key.created", created.key_id)
    assert row.tenant_id == tenant and row.detail["actor"] == {"kind": "operator"}


# -- revocation and expiry ----------------------------------------------------------------------


async def test_a_revoked_key_stops_within_five_seconds_on_every_replica_streams_included(
    stack: RunningStack, gateway_channel: grpc.aio.Channel
) -> None:
    second = await stack.services.start("gateway")
    try:
        async with grpc.aio.insecure_channel(second.address) as other_channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(gateway_channel)
            other = gateway_pb2_grpc.GatewayServiceStub(other_channel)
            admin = await tenant_admin(stack)
            doomed = await create_key(stub, admin, principal_id="leaver")
            # No worker runs here: the run stays queued and its stream stays open.
            sent = await other.SendMessage(
                gateway_pb2.SendMessageRequest(text="x", conversation_id="c", event_id=uid()),
                metadata=meta(doomed.api_key),
            )
            stream = other.StreamRun(
                gateway_pb2.StreamRunRequest(run_id=sent.run.run_id), metadata=meta(doomed.api_key)
            )
            first = await stream.read()
            assert first.HasField("snapshot")
            get = gateway_pb2.GetRunRequest(run_id=sent.run.run_id)
            await other.GetRun(get, metadata=meta(doomed.api_key))  # cached on the replica

            async def stream_end() -> grpc.StatusCode:
                try:
                    while await stream.read() is not grpc.aio.EOF:
                        pass  # keepalives
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
                return grpc.StatusCode.OK

            ended = asyncio.ensure_future(stream_end())
            started = time.monotonic()
            revoked = await stub.RevokeApiKey(
                gateway_pb2.RevokeApiKeyRequest(key_id=doomed.key_id), metadata=meta(admin)
            )
            assert revoked.revoked

            async def refused_on_the_other_replica() -> bool:
                try:
                    await other.GetRun(get, metadata=meta(doomed.api_key))
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
                    return True
                return False

            await eventually(
                refused_on_the_other_replica, timeout=REVOCATION_S + SLACK_S, interval=0.1
            )
            code = await asyncio.wait_for(ended, REVOCATION_S + SLACK_S)
            assert code == grpc.StatusCode.UNAUTHENTICATED
            assert time.monotonic() - started <= REVOCATION_S + SLACK_S
            again = await stub.RevokeApiKey(
                gateway_pb2.RevokeApiKeyRequest(key_id=doomed.key_id), metadata=meta(admin)
            )
            assert not again.revoked, "revoking twice changes nothing"
    finally:
        await stack.services.stop(second.name)
    (created,) = await audit_rows(stack, "key.created", doomed.key_id)
    (revoked_row,) = await audit_rows(stack, "key.revoked", doomed.key_id)
    assert created.tenant_id == revoked_row.tenant_id == "tenant-a"
    assert created.detail["scopes"] == sorted(apikeys.CLIENT_SCOPES), "the default scopes"
    assert revoked_row.detail["actor"]["kind"] == "key"
    assert revoked_row.detail["actor"]["principal_id"].startswith("admin-")
    assert revoked_row.created_at >= created.created_at


async def test_an_expired_key_is_refused(
    stack: RunningStack, gateway_channel: grpc.aio.Channel
) -> None:
    stub = gateway_pb2_grpc.GatewayServiceStub(gateway_channel)
    admin = await tenant_admin(stack)
    past = Timestamp()
    past.FromDatetime(datetime.now(UTC) - timedelta(seconds=1))
    bad = await refused(create_key(stub, admin, principal_id="p", expires_at=past))
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    soon = Timestamp()
    soon.FromDatetime(datetime.now(UTC) + timedelta(seconds=1.5))
    brief = await create_key(stub, admin, principal_id="temp", expires_at=soon)
    listing = gateway_pb2.ListRunsRequest()
    await stub.ListRuns(listing, metadata=meta(brief.api_key))  # valid (and cached) until then

    async def refused_now() -> bool:
        try:
            await stub.ListRuns(listing, metadata=meta(brief.api_key))
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
            return True
        return False

    await eventually(refused_now, timeout=5.0, interval=0.1, what="the expired key refused")
    assert datetime.now(UTC) >= soon.ToDatetime(tzinfo=UTC), "refused only once expired"


async def test_keys_are_revoked_over_http_and_from_the_cli(
    stack: RunningStack, gateway_channel: grpc.aio.Channel, tmp_path: Path
) -> None:
    stub = gateway_pb2_grpc.GatewayServiceStub(gateway_channel)
    admin = await tenant_admin(stack)
    theirs = await create_key(stub, await tenant_admin(stack, "tenant-b"), principal_id="b")
    mine = await create_key(stub, admin, principal_id="a")
    http = stack.services.http_addresses()["gateway"]

    def post(path: str) -> tuple[int, dict[str, Any]]:
        request = urllib.request.Request(
            f"http://{http}{path}", method="POST", headers={"Authorization": f"Bearer {admin}"}
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    status, body = await asyncio.to_thread(post, f"/v1/keys/{theirs.key_id}/revoke")
    absent_status, absent = await asyncio.to_thread(post, "/v1/keys/key_nope/revoke")
    assert status == absent_status == 404
    assert body["error"]["message"].replace(theirs.key_id, "X") == absent["error"][
        "message"
    ].replace("key_nope", "X"), "another tenant's key looks absent"
    status, body = await asyncio.to_thread(post, f"/v1/keys/{mine.key_id}/revoke")
    assert (status, body) == (200, {"key_id": mine.key_id, "revoked": True})

    cli_key = await create_key(stub, admin, principal_id="c")
    stack_file = tmp_path / "stack.json"
    stack_file.write_text(json.dumps({"gateway": stack.gateway, "api_key": admin}))
    done = await asyncio.to_thread(
        subprocess.run,
        [*CLI, "keys", "revoke", cli_key.key_id, "--json", "--stack", str(stack_file)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"key_id": cli_key.key_id, "revoked": True}
    # The other tenant's key still works: nothing above touched it.
    await stub.ListRuns(gateway_pb2.ListRunsRequest(), metadata=meta(theirs.api_key))


# -- internal services: each its own credential, each only its own powers -----------------------


async def test_each_service_credential_reaches_only_its_own_rpcs(stack: RunningStack) -> None:
    addresses = stack.services.addresses()
    worker = stack.credentials["worker"]
    async with (
        internal_channel(addresses["orchestrator"], worker) as orchestrator_channel,
        internal_channel(addresses["interactions"], worker) as interactions_channel,
    ):
        orchestrator = orchestrator_pb2_grpc.OrchestratorServiceStub(orchestrator_channel)
        store = interactions_pb2_grpc.InteractionsServiceStub(interactions_channel)
        denied = [
            await refused(
                store.RecordDecision(
                    interactions_pb2.RecordDecisionRequest(
                        tenant_id="tenant-a", principal_id="alice", run_id="r", decision="deny"
                    )
                )
            ),
            await refused(
                store.RecordAnswers(interactions_pb2.RecordAnswersRequest(tenant_id="tenant-a"))
            ),
            await refused(orchestrator.ResumeRun(orchestrator_pb2.ResumeRunRequest(run_id="r"))),
            await refused(
                orchestrator.SearchRuns(orchestrator_pb2.SearchRunsRequest(tenant_id="tenant-a"))
            ),
            await refused(
                orchestrator.LookupRun(
                    orchestrator_pb2.LookupRunRequest(tenant_id="tenant-a", run_id="r")
                )
            ),
        ]
        assert [e.code() for e in denied] == [grpc.StatusCode.PERMISSION_DENIED] * len(denied)
        assert "worker" in (denied[0].details() or "")
        # Its own calls go through (to the lease fence: it holds no lease here).
        beat = await refused(
            orchestrator.Heartbeat(orchestrator_pb2.HeartbeatRequest(run_id="r", epoch=1))
        )
        assert beat.code() == grpc.StatusCode.FAILED_PRECONDITION, beat.details()
        stale = await refused(
            store.CheckGrant(
                interactions_pb2.CheckGrantRequest(
                    run_id="run_" + "0" * 32, epoch=999, tool_name="t", risk_category="write"
                )
            )
        )
        assert stale.code() == grpc.StatusCode.FAILED_PRECONDITION, "CheckGrant is fenced too"
    async with internal_channel(addresses["orchestrator"], stack.credentials["gateway"]) as ch:
        gateway_on_orchestrator = orchestrator_pb2_grpc.OrchestratorServiceStub(ch)
        claim_as_gateway = await refused(
            gateway_on_orchestrator.ClaimRun(orchestrator_pb2.ClaimRunRequest(worker_id="g"))
        )
        assert claim_as_gateway.code() == grpc.StatusCode.PERMISSION_DENIED
    async with internal_channel(addresses["orchestrator"], "forged-" + uid()) as ch:
        forged = await refused(
            orchestrator_pb2_grpc.OrchestratorServiceStub(ch).ClaimRun(
                orchestrator_pb2.ClaimRunRequest(worker_id="f")
            )
        )
        assert forged.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_only_the_interactions_service_looks_up_run_facts_and_names_who_asks(
    stack: RunningStack,
) -> None:
    orchestrator = stack.services.addresses()["orchestrator"]
    absent = "run_" + "0" * 32
    by_lease = orchestrator_pb2.LookupRunFactsRequest(run_id=absent, lease_epoch=1)
    for caller in ("worker", "gateway"):
        async with internal_channel(orchestrator, stack.credentials[caller]) as ch:
            stub = orchestrator_pb2_grpc.OrchestratorServiceStub(ch)
            denied = await refused(stub.LookupRunFacts(by_lease))
        assert denied.code() == grpc.StatusCode.PERMISSION_DENIED, caller
    async with internal_channel(orchestrator, stack.credentials["interactions"]) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(ch)
        stale = await refused(stub.LookupRunFacts(by_lease))
        unseen = await refused(
            stub.LookupRunFacts(
                orchestrator_pb2.LookupRunFactsRequest(
                    run_id=absent,
                    viewer=orchestrator_pb2.RunViewer(tenant_id="tenant-a", all_runs=True),
                )
            )
        )
        nameless = await refused(
            stub.LookupRunFacts(orchestrator_pb2.LookupRunFactsRequest(run_id=absent))
        )
    assert stale.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert dict(stale.trailing_metadata() or ())["tether-error-code"] == "stale_lease"
    assert unseen.code() == grpc.StatusCode.NOT_FOUND
    assert nameless.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "viewer or a lease_epoch" in (nameless.details() or "")


async def test_the_deprecated_binding_lookup_still_answers_the_previous_release(
    stack: RunningStack,
) -> None:
    """Interactions replicas of the previous release ask LookupBinding during a rolling deploy."""
    async with TetherClient(stack.gateway, stack.key_a) as client:
        uid = uuid.uuid4().hex
        sent = await client.send(f"binding {uid}", conversation_id=f"c-{uid}", event_id=uid)
        run_id = sent.run.run_id
    orchestrator = stack.services.addresses()["orchestrator"]
    async with internal_channel(orchestrator, stack.credentials["interactions"]) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(ch)
        found = await stub.LookupBinding(
            orchestrator_pb2.LookupBindingRequest(tenant_id="tenant-a", run_id=run_id)
        )
        elsewhere = await refused(
            stub.LookupBinding(
                orchestrator_pb2.LookupBindingRequest(tenant_id="tenant-b", run_id=run_id)
            )
        )
    assert (found.status, found.waiting_interaction_id) == (common_pb2.RUN_STATUS_QUEUED, "")
    assert elsewhere.code() == grpc.StatusCode.NOT_FOUND


async def test_a_service_without_its_credential_refuses_to_start(
    stack: RunningStack, tmp_path: Path
) -> None:
    missing = {"orchestrator": "TETHER_SERVICE_VERIFIERS", "worker": "TETHER_SERVICE_CREDENTIAL"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_SERVICE_")}
    env.update(
        TETHER_DATABASE_URL=stack.db_url,
        TETHER_ORCHESTRATOR_ADDR=stack.services.addresses()["orchestrator"],
        TETHER_INTERACTIONS_ADDR=stack.services.addresses()["interactions"],
    )
    # Both at once: importing a service takes seconds on a loaded two-core machine.
    processes = {
        service: subprocess.Popen(
            [sys.executable, "-m", f"services.{service}"],
            env={**env, "TETHER_READY_FILE": str(tmp_path / service)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for service in missing
    }

    def settled() -> bool:
        # Each either exits or serves (writes its ready file).
        return all(
            p.poll() is not None or (tmp_path / name).exists() for name, p in processes.items()
        )

    try:
        await eventually(
            lambda: asyncio.sleep(0, settled()), timeout=90.0, interval=0.05, what="exit or serve"
        )
        for service, process in processes.items():
            assert not (tmp_path / service).exists(), f"{service} started without its credential"
            assert process.wait() != 0
            assert process.stderr is not None
            stderr = process.stderr.read()
            assert missing[service] in stderr, stderr[-2000:]
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
            process.wait()


async def _never() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
    """A request stream that sends nothing: a request written while a refusal is on its way
    back would hide the refusal's status (grpc reports such a call as INTERNAL)."""
    await asyncio.Event().wait()
    yield reflection_pb2.ServerReflectionRequest()


async def test_reflection_is_off_on_the_public_gateway_and_internal_without_a_credential(
    stack: RunningStack,
) -> None:
    addresses = stack.services.addresses()
    async with grpc.aio.insecure_channel(addresses["gateway"]) as channel:
        silent = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(_never())
        off = await refused(anext(aiter(silent)))
        assert off.code() == grpc.StatusCode.UNIMPLEMENTED
    for service in ("admission", "orchestrator", "interactions"):
        async with grpc.aio.insecure_channel(addresses[service]) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            # Bounded: a server that serves the call waits for a request instead of refusing.
            async with asyncio.timeout(10):
                anonymous = await refused(anext(aiter(stub.ServerReflectionInfo(_never()))))
                assert anonymous.code() == grpc.StatusCode.UNAUTHENTICATED, service
                forged = stub.ServerReflectionInfo(_never(), metadata=((CREDENTIAL_KEY, "x"),))
                forged_code = (await refused(anext(aiter(forged)))).code()
                assert forged_code == grpc.StatusCode.UNAUTHENTICATED, service
            responses = stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                metadata=((CREDENTIAL_KEY, stack.credentials["gateway"]),),
            )
            listed = [s.name async for r in responses for s in r.list_services_response.service]
            assert f"tether.v1.{service.capitalize()}Service" in listed, "a caller service reads it"
