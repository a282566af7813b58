"""The stack as real processes: authentication, tenancy, statuses and the CLI."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from sqlalchemy import func, select

from tests.system.conftest import RunningStack
from tether.credentials import CREDENTIAL_KEY
from tether.db.engine import create_engine
from tether.db.schema import event_claims, messages, runs, sessions
from tether.runtime.rpc import internal_channel
from tether.v1 import (
    admission_pb2,
    admission_pb2_grpc,
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
)


def uid() -> str:
    return uuid.uuid4().hex[:12]


async def row_counts(stack: RunningStack) -> tuple[int, ...]:
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            return tuple(
                [
                    (await conn.execute(select(func.count()).select_from(t))).scalar_one()
                    for t in (event_claims, sessions, messages, runs)
                ]
            )
    finally:
        await engine.dispose()


async def send(
    gateway: grpc.aio.Channel, key: str, text: str = "hello", **fields: Any
) -> gateway_pb2.SendMessageResponse:
    stub = gateway_pb2_grpc.GatewayServiceStub(gateway)
    request = gateway_pb2.SendMessageRequest(
        text=text,
        conversation_id=fields.pop("conversation_id", "conv-1"),
        event_id=fields.pop("event_id", f"e-{uid()}"),
        **fields,
    )
    return await stub.SendMessage(request, metadata=(("authorization", f"Bearer {key}"),))


async def refused(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


async def test_send_then_get_returns_the_queued_run(
    stack: RunningStack, gateway_channel: grpc.aio.Channel
) -> None:
    sent = await send(gateway_channel, stack.key_a, "hello")
    assert sent.disposition == common_pb2.DISPOSITION_CREATED
    assert sent.run.status == common_pb2.RUN_STATUS_QUEUED
    assert sent.run.tenant_id == "tenant-a"
    stub = gateway_pb2_grpc.GatewayServiceStub(gateway_channel)
    got = await stub.GetRun(
        gateway_pb2.GetRunRequest(run_id=sent.run.run_id), metadata=stack.metadata(stack.key_a)
    )
    assert got.run.run_id == sent.run.run_id
    assert got.run.input_text == "hello"


async def test_every_auth_failure_has_its_status(
    stack: RunningStack, gateway_channel: grpc.aio.Channel
) -> None:
    stub = gateway_pb2_grpc.GatewayServiceStub(gateway_channel)
    request = gateway_pb2.SendMessageRequest(text="x", conversation_id="c", event_id=uid())
    none = await refused(stub.SendMessage(request))
    assert none.code() == grpc.StatusCode.UNAUTHENTICATED
    bad = await refused(stub.SendMessage(request, metadata=stack.metadata("tk_forged")))
    assert bad.code() == grpc.StatusCode.UNAUTHENTICATED
    scope = await refused(stub.SendMessage(request, metadata=stack.metadata(stack.read_only_key)))
    assert scope.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "runs:write" in (scope.details() or "")
    admin_only = await refused(
        stub.CreateApiKey(
            gateway_pb2.CreateApiKeyRequest(tenant_id="x", principal_id="y"),
            metadata=stack.metadata(stack.key_a),
        )
    )
    assert admin_only.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_another_tenants_run_is_indistinguishable_from_a_missing_one(
    stack: RunningStack, gateway_channel: grpc.aio.Channel
) -> None:
    theirs = await send(gateway_channel, stack.key_b, "private")
    stub = gateway_pb2_grpc.GatewayServiceStub(gateway_channel)
    meta = stack.metadata(stack.key_a)
    other = await refused(
        stub.GetRun(gateway_pb2.GetRunRequest(run_id=theirs.run.run_id), metadata=meta)
    )
    absent_id = "run_" + "0" * 32
    absent = await refused(stub.GetRun(gateway_pb2.GetRunRequest(run_id=absent_id), metadata=meta))
    assert other.code() == absent.code() == grpc.StatusCode.NOT_FOUND
    assert (other.details() or "").replace(theirs.run.run_id, "ID") == (
        absent.details() or ""
    ).replace(absent_id, "ID")
    cancel = await refused(
        stub.CancelRun(gateway_pb2.CancelRunRequest(run_id=theirs.run.run_id), metadata=meta)
    )
    assert cancel.code() == grpc.StatusCode.NOT_FOUND
    listed = await stub.ListRuns(gateway_pb2.ListRunsRequest(page_size=200), metadata=meta)
    assert theirs.run.run_id not in {r.run_id for r in listed.runs}


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"event_id": ""}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"event_id": "bad id"}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"conversation_id": ""}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"text": ""}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"text": "x" * 40_000}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"channel": "no spaces allowed"}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"tenant_id": "tenant-b"}, grpc.StatusCode.PERMISSION_DENIED),
    ],
)
async def test_bad_input_gets_its_status_and_writes_nothing(
    stack: RunningStack,
    gateway_channel: grpc.aio.Channel,
    fields: dict[str, str],
    code: grpc.StatusCode,
) -> None:
    before = await row_counts(stack)
    fields = dict(fields)
    text = fields.pop("text", "hello")
    error = await refused(send(gateway_channel, stack.key_a, text, **fields))
    assert error.code() == code
    assert error.details()
    assert await row_counts(stack) == before


async def test_conflicting_redelivery_is_already_exists_and_writes_nothing(
    stack: RunningStack, gateway_channel: grpc.aio.Channel
) -> None:
    event_id = f"e-{uid()}"
    await send(gateway_channel, stack.key_a, "yes", event_id=event_id)
    before = await row_counts(stack)
    error = await refused(send(gateway_channel, stack.key_a, "no", event_id=event_id))
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS
    assert dict(error.trailing_metadata() or ())["tether-error-code"] == "idempotency_conflict"
    assert await row_counts(stack) == before
    again = await send(gateway_channel, stack.key_a, "yes", event_id=event_id)
    assert again.disposition == common_pb2.DISPOSITION_ATTACHED


async def test_list_runs_is_newest_first_filtered_and_paged(
    stack: RunningStack, gateway_channel: grpc.aio.Channel
) -> None:
    conversation = f"conv-{uid()}"
    sent = [
        (await send(gateway_channel, stack.key_a, f"m{i}", conversation_id=conversation)).run.run_id
        for i in range(5)
    ]
    stub = gateway_pb2_grpc.GatewayServiceStub(gateway_channel)
    meta = stack.metadata(stack.key_a)
    seen: list[str] = []
    token = ""
    while True:
        page = await stub.ListRuns(
            gateway_pb2.ListRunsRequest(
                conversation_id=conversation, page_size=2, page_token=token
            ),
            metadata=meta,
        )
        seen += [r.run_id for r in page.runs]
        token = page.next_page_token
        if not token:
            break
    assert seen == list(reversed(sent))
    bad = await refused(
        stub.ListRuns(gateway_pb2.ListRunsRequest(page_token="garbage!"), metadata=meta)
    )
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    queued = await stub.ListRuns(
        gateway_pb2.ListRunsRequest(
            conversation_id=conversation, statuses=[common_pb2.RUN_STATUS_COMPLETED]
        ),
        metadata=meta,
    )
    assert list(queued.runs) == []


async def test_cancel_a_queued_run_then_cancel_again_reports_it_unchanged(
    stack: RunningStack, gateway_channel: grpc.aio.Channel
) -> None:
    sent = await send(gateway_channel, stack.key_a, "cancel me")
    stub = gateway_pb2_grpc.GatewayServiceStub(gateway_channel)
    meta = stack.metadata(stack.key_a)
    first = await stub.CancelRun(
        gateway_pb2.CancelRunRequest(run_id=sent.run.run_id, reason="changed my mind"),
        metadata=meta,
    )
    assert first.changed and first.run.status == common_pb2.RUN_STATUS_CANCELLED
    second = await stub.CancelRun(
        gateway_pb2.CancelRunRequest(run_id=sent.run.run_id), metadata=meta
    )
    assert not second.changed and second.run.status == common_pb2.RUN_STATUS_CANCELLED
    assert second.run.updated_at == first.run.updated_at


async def test_internal_services_refuse_callers_without_the_platform_credential(
    stack: RunningStack,
) -> None:
    addresses = stack.services.addresses()
    request = admission_pb2.AdmitRequest(
        caller=admission_pb2.Caller(tenant_id="tenant-a", principal_id="mallory"),
        chat=admission_pb2.ChatInput(event_id=uid(), conversation_id="c", text="forged"),
    )
    async with grpc.aio.insecure_channel(addresses["admission"]) as channel:
        error = await refused(admission_pb2_grpc.AdmissionServiceStub(channel).Admit(request))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    async with grpc.aio.insecure_channel(addresses["orchestrator"]) as channel:
        error = await refused(
            orchestrator_pb2_grpc.OrchestratorServiceStub(channel).SearchRuns(
                orchestrator_pb2.SearchRunsRequest(tenant_id="tenant-a")
            )
        )
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    async with internal_channel(addresses["orchestrator"], stack.credentials["gateway"]) as channel:
        ok = await orchestrator_pb2_grpc.OrchestratorServiceStub(channel).SearchRuns(
            orchestrator_pb2.SearchRunsRequest(tenant_id="tenant-a")
        )
    assert ok is not None


async def test_every_service_serves_health_and_reflection(stack: RunningStack) -> None:
    for name, address in stack.services.addresses().items():
        async with grpc.aio.insecure_channel(address) as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest()
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING, name
            if name == "gateway":
                continue  # the public edge serves reflection only when asked to
            # An internal service's, to a service it knows (test_credentials: to no one else).
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            responses = stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                metadata=((CREDENTIAL_KEY, stack.credentials["gateway"]),),
            )
            listed = [s.name async for r in responses for s in r.list_services_response.service]
            assert "grpc.health.v1.Health" in listed, name
            assert any(s.startswith("tether.v1.") for s in listed), name


async def test_cli_send_run_runs_and_refusals(stack: RunningStack, tmp_path: Path) -> None:
    stack_file = tmp_path / "stack.json"
    stack_file.write_text(json.dumps({"gateway": stack.gateway, "api_key": stack.key_a}))
    conversation = f"cli-{uid()}"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tether.cli", *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    sent = await asyncio.to_thread(
        cli,
        "send",
        "hello from the cli",
        "--conversation",
        conversation,
        "--json",
        "--stack",
        str(stack_file),
    )
    assert sent.returncode == 0, sent.stderr
    created = json.loads(sent.stdout)
    assert created["status"] == "queued" and created["disposition"] == "created"
    shown = await asyncio.to_thread(
        cli, "--stack", str(stack_file), "run", created["run_id"], "--json"
    )
    assert json.loads(shown.stdout)["run_id"] == created["run_id"]
    second = json.loads(
        (
            await asyncio.to_thread(
                cli,
                "send",
                "again",
                "--conversation",
                conversation,
                "--json",
                "--stack",
                str(stack_file),
            )
        ).stdout
    )
    listed = await asyncio.to_thread(
        cli, "runs", "--conversation", conversation, "--json", "--stack", str(stack_file)
    )
    ids = [json.loads(line)["run_id"] for line in listed.stdout.splitlines()]
    assert ids == [second["run_id"], created["run_id"]]
    missing = await asyncio.to_thread(cli, "run", "run_nope", "--stack", str(stack_file))
    assert missing.returncode != 0
    assert "NOT_FOUND" in missing.stderr
    bad = await asyncio.to_thread(
        cli, "send", "x", "--event-id", "not valid", "--stack", str(stack_file)
    )
    assert bad.returncode != 0 and "INVALID_ARGUMENT" in bad.stderr


async def test_cli_output_to_a_closed_pipe_ends_quietly(
    stack: RunningStack, gateway_channel: grpc.aio.Channel, tmp_path: Path
) -> None:
    """`tether runs --json | head -1`: the reader is gone before the next line is written."""
    conversation = f"pipe-{uid()}"
    for _ in range(2):
        await send(gateway_channel, stack.key_a, conversation_id=conversation)
    stack_file = tmp_path / "stack.json"
    stack_file.write_text(json.dumps({"gateway": stack.gateway, "api_key": stack.key_a}))
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write the CLI makes meets a reader that went away
    try:
        ended = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "tether.cli", "runs", "--json", "--stack", str(stack_file)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    assert "Traceback" not in ended.stderr and "BrokenPipeError" not in ended.stderr, ended.stderr
    assert ended.stderr == ""
    assert ended.returncode == 1, "Python's exit code for EPIPE (the signal module's docs)"


async def test_submit_event_admits_webhook_task_and_decision_inputs(
    stack: RunningStack, gateway_channel: grpc.aio.Channel
) -> None:
    stub = gateway_pb2_grpc.GatewayServiceStub(gateway_channel)
    meta = stack.metadata(stack.key_a)
    webhook = admission_pb2.MessagingWebhookInput(
        provider="whatsapp",
        provider_event_id=f"m-{uid()}",
        thread_id="thread-1",
        sender_id="guest-1",
        sender_type="guest",
        text="Any update on the repair?",
    )
    first = await stub.SubmitEvent(gateway_pb2.SubmitEventRequest(messaging=webhook), metadata=meta)
    again = await stub.SubmitEvent(gateway_pb2.SubmitEventRequest(messaging=webhook), metadata=meta)
    assert first.disposition == common_pb2.DISPOSITION_CREATED
    assert again.disposition == common_pb2.DISPOSITION_ATTACHED
    assert again.run.run_id == first.run.run_id
    assert first.run.channel == "whatsapp" and first.run.conversation_id == "thread-1"
    task = await stub.SubmitEvent(
        gateway_pb2.SubmitEventRequest(
            task_status=admission_pb2.TaskStatusInput(
                task_id="T-7", status_event_id=f"s-{uid()}", status="done"
            )
        ),
        metadata=meta,
    )
    assert task.run.input_text == "Task T-7 is now done."
    decision = await stub.SubmitEvent(
        gateway_pb2.SubmitEventRequest(
            decision=admission_pb2.DecisionInput(
                decision_id=f"d-{uid()}", conversation_id="conv-1", decision="refund approved"
            )
        ),
        metadata=meta,
    )
    assert decision.disposition == common_pb2.DISPOSITION_CREATED
    before = await row_counts(stack)
    foreign = admission_pb2.MessagingWebhookInput(
        provider="whatsapp",
        provider_event_id=f"m-{uid()}",
        thread_id="t",
        sender_id="g",
        text="hi",
        tenant_id="tenant-b",
    )
    error = await refused(
        stub.SubmitEvent(gateway_pb2.SubmitEventRequest(messaging=foreign), metadata=meta)
    )
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    empty = await refused(stub.SubmitEvent(gateway_pb2.SubmitEventRequest(), metadata=meta))
    assert empty.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await row_counts(stack) == before
