"""Run-event webhook subscriptions through gRPC, the HTTP v2 routes and the CLI, on the shared
stack (private targets not allowed): a loopback endpoint is refused and nothing is stored; an
unknown event type or a malformed secret is INVALID_ARGUMENT naming what is allowed; the secret
appears in no answer, listing or service log; add and remove each write an audit record."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
import uuid
from pathlib import Path

import grpc
import httpx2
import pytest
from sqlalchemy import select

from tests.system.conftest import RunningStack
from tether.db.engine import create_engine
from tether.db.schema import audit_log
from tether.runtime.rpc import internal_channel
from tether.v1 import gateway_pb2, gateway_pb2_grpc, interactions_pb2, interactions_pb2_grpc

# A public address given literally: accepted with no DNS, and never sent to (no run of the
# stack's ends: it has no worker).
# a whole stack of processes per module: tens of seconds, so in `make slow` (the 15-minute budget)
pytestmark = pytest.mark.slow


PUBLIC_URL = "https://8.8.8.8/tether-test-hook"


def new_secret() -> str:
    return "whsec_" + base64.b64encode(os.urandom(24)).decode()


async def _tether(stack: RunningStack, tmp_path: Path, *args: str) -> tuple[int, str]:
    stack_file = tmp_path / f"stack-{uuid.uuid4().hex[:6]}.json"
    stack_file.write_text(json.dumps({"gateway": stack.gateway, "api_key": stack.admin_key}))
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tether.cli",
        *args,
        "--stack",
        str(stack_file),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode() + err.decode()


async def _audit_actions(stack: RunningStack, subscription_id: str) -> list[str]:
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(
                select(audit_log.c.action, audit_log.c.detail).order_by(audit_log.c.created_at)
            )
            return [r.action for r in rows if r.detail.get("subscription_id") == subscription_id]
    finally:
        await engine.dispose()


async def test_a_loopback_endpoint_is_refused_and_nothing_is_stored(
    stack: RunningStack, gateway_channel: grpc.aio.Channel
) -> None:
    stub = gateway_pb2_grpc.GatewayServiceStub(gateway_channel)
    metadata = stack.metadata(stack.admin_key)
    secret = new_secret()
    for url in ("http://127.0.0.1:9/hook", "http://[::1]:9/hook", "http://localhost:9/hook"):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.AddWebhook(
                gateway_pb2.AddWebhookRequest(url=url, events=["run.completed"], secret=secret),
                metadata=metadata,
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, url
        assert "TETHER_ALLOW_PRIVATE_TARGETS" in (refused.value.details() or ""), url
    http_base = f"http://{stack.services.http_addresses()['gateway']}"
    auth = {"Authorization": f"Bearer {stack.admin_key}"}
    async with httpx2.AsyncClient(base_url=http_base, timeout=30) as http:
        answer = await http.post(
            "/v2/webhooks/subscriptions",
            headers=auth,
            json={"url": "http://127.0.0.1:9/hook", "events": ["run.completed"], "secret": secret},
        )
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["status"] == "INVALID_ARGUMENT"
        assert "loopback" in answer.json()["error"]["message"]
        listed = await http.get("/v2/webhooks/subscriptions", headers=auth)
        assert listed.status_code == 200, listed.text
        assert listed.json().get("subscriptions", []) == []
    assert secret not in answer.text


@pytest.mark.parametrize(
    ("events", "secret", "named"),
    [
        (["run.finished"], None, "run.completed, run.failed, run.cancelled"),
        ([], None, "approval.requested"),
        (["run.completed"], "not a secret!", "whsec_"),
        (["run.completed"], "", "whsec_"),
    ],
)
async def test_bad_input_is_invalid_argument_naming_what_is_allowed(
    stack: RunningStack,
    gateway_channel: grpc.aio.Channel,
    events: list[str],
    secret: str | None,
    named: str,
) -> None:
    stub = gateway_pb2_grpc.GatewayServiceStub(gateway_channel)
    request = gateway_pb2.AddWebhookRequest(
        url=PUBLIC_URL, events=events, secret=new_secret() if secret is None else secret
    )
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.AddWebhook(request, metadata=stack.metadata(stack.admin_key))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in (refused.value.details() or "")


async def test_the_cli_adds_lists_and_removes_and_never_shows_the_secret(
    stack: RunningStack, tmp_path: Path
) -> None:
    secret = new_secret()
    secret_file = tmp_path / "secret"
    secret_file.write_text(secret + "\n")
    code, out = await _tether(
        stack,
        tmp_path,
        "webhooks",
        "add",
        PUBLIC_URL,
        "--events",
        "run.completed,approval.requested,delivery.failed",
        "--secret-file",
        str(secret_file),
        "--json",
    )
    assert code == 0, out
    subscription_id = json.loads(out)["subscription_id"]
    code, listed = await _tether(stack, tmp_path, "webhooks", "list", "--json")
    assert code == 0, listed
    [shown] = [json.loads(line) for line in listed.splitlines() if subscription_id in line]
    assert shown["status"] == "enabled" and shown["url"] == PUBLIC_URL
    assert shown["events"] == ["run.completed", "approval.requested", "delivery.failed"]
    code, logged = await _tether(stack, tmp_path, "webhooks", "deliveries", subscription_id)
    assert code == 0 and logged.strip() == "", logged
    http_base = f"http://{stack.services.http_addresses()['gateway']}"
    auth = {"Authorization": f"Bearer {stack.admin_key}"}
    async with httpx2.AsyncClient(base_url=http_base, timeout=30) as http:
        over_http = await http.get("/v2/webhooks/subscriptions", headers=auth)
        log_http = await http.get(
            f"/v2/webhooks/subscriptions/{subscription_id}/deliveries", headers=auth
        )
        assert log_http.status_code == 200, log_http.text
        code, removed = await _tether(stack, tmp_path, "webhooks", "rm", subscription_id)
        assert code == 0, removed
        gone = await http.delete(f"/v2/webhooks/subscriptions/{subscription_id}", headers=auth)
        assert gone.status_code == 404, gone.text
        assert gone.json()["error"]["status"] == "NOT_FOUND"
    code, again = await _tether(stack, tmp_path, "webhooks", "redeliver", "msg_absent")
    assert code == 1 and "error: NOT_FOUND: no webhook delivery 'msg_absent'" in again, again
    for text in (out, listed, logged, over_http.text, log_http.text, removed):
        assert secret not in text
        assert secret.removeprefix("whsec_") not in text
    assert await _audit_actions(stack, subscription_id) == ["webhook.added", "webhook.removed"]
    for proc in stack.services.procs.values():
        assert secret.removeprefix("whsec_") not in proc.log_path.read_text(errors="replace")


async def _open_secret(
    stack: RunningStack, caller: str, tenant_id: str, subscription_id: str
) -> str:
    address = stack.services.addresses()["interactions"]
    async with internal_channel(address, stack.credentials[caller]) as channel:
        opened = await interactions_pb2_grpc.InteractionsServiceStub(channel).OpenWebhookSecret(
            interactions_pb2.OpenWebhookSecretRequest(
                tenant_id=tenant_id, subscription_id=subscription_id
            )
        )
        return str(opened.secret)


async def test_only_the_orchestrator_opens_a_subscriptions_secret(
    stack: RunningStack, gateway_channel: grpc.aio.Channel
) -> None:
    stub = gateway_pb2_grpc.GatewayServiceStub(gateway_channel)
    secret = new_secret()
    added = await stub.AddWebhook(
        gateway_pb2.AddWebhookRequest(url=PUBLIC_URL, events=["run.failed"], secret=secret),
        metadata=stack.metadata(stack.admin_key),
    )
    assert secret not in str(added)
    subscription_id = added.subscription_id
    assert await _open_secret(stack, "orchestrator", "ops", subscription_id) == secret
    for caller in ("gateway", "worker", "interactions"):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _open_secret(stack, caller, "ops", subscription_id)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, caller
    # Bound to its tenant: the same id under another tenant opens nothing.
    with pytest.raises(grpc.aio.AioRpcError) as elsewhere:
        await _open_secret(stack, "orchestrator", "tenant-a", subscription_id)
    assert elsewhere.value.code() == grpc.StatusCode.NOT_FOUND
    await stub.RemoveWebhook(
        gateway_pb2.RemoveWebhookRequest(subscription_id=subscription_id),
        metadata=stack.metadata(stack.admin_key),
    )
    with pytest.raises(grpc.aio.AioRpcError) as removed:
        await _open_secret(stack, "orchestrator", "ops", subscription_id)
    assert removed.value.code() == grpc.StatusCode.NOT_FOUND
