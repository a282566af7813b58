"""A caller's mistakes, sent for real to the gateway's gRPC service and its HTTP bridge (services
as processes): each gets its status and a message a person can act on, over HTTP in the JSON
error shape, and writes nothing. Never INTERNAL, UNKNOWN or a 500."""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx2
import pytest
import pytest_asyncio
from google.protobuf.message import Message

from tests.system.bad_input_support import (
    GATEWAY_SERVICE,
    HostileStack,
    assert_json_error,
)
from tether.v1 import admission_pb2, common_pb2, gateway_pb2, gateway_pb2_grpc, interactions_pb2

MARK = "\u2603" * 4  # 12 UTF-8 bytes that nothing else in a request contains


def uid() -> str:
    return uuid.uuid4().hex[:12]


def with_bytes(message: Message, replacement: bytes) -> bytes:
    """`message` serialised, with the UTF-8 of MARK (in one of its strings) replaced by
    `replacement` of the same length: the length prefixes stay right, only the bytes go bad."""
    raw = message.SerializeToString()
    mark = MARK.encode()
    assert len(replacement) == len(mark) and raw.count(mark) == 1
    return raw.replace(mark, replacement)


async def call_raw(
    channel: grpc.aio.Channel, method: str, body: bytes, key: str
) -> grpc.aio.AioRpcError:
    """Send raw bytes as the request of a unary gateway method; returns the refusal."""
    call = channel.unary_unary(f"/{GATEWAY_SERVICE}/{method}")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(body, metadata=(("authorization", f"Bearer {key}"),), timeout=10)
    return info.value


async def refused(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


@pytest_asyncio.fixture(loop_scope="session")
async def http(hostile_stack: HostileStack) -> AsyncIterator[httpx2.AsyncClient]:
    async with httpx2.AsyncClient(base_url=hostile_stack.http_base, timeout=10) as client:
        yield client


@pytest_asyncio.fixture(loop_scope="session")
async def channel(hostile_stack: HostileStack) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(hostile_stack.gateway) as opened:
        yield opened


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# -- gRPC ---------------------------------------------------------------------------------------


async def test_invalid_utf8_in_send_message_text_is_invalid_argument(
    hostile_stack: HostileStack, channel: grpc.aio.Channel
) -> None:
    before = await hostile_stack.row_counts()
    body = with_bytes(
        gateway_pb2.SendMessageRequest(event_id=uid(), conversation_id="c", text=MARK),
        b"\xff\xfe" * 6,
    )
    error = await call_raw(channel, "SendMessage", body, hostile_stack.key_a)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "UTF-8" in (error.details() or "")
    assert await hostile_stack.row_counts() == before


async def test_invalid_utf8_in_a_stream_request_is_invalid_argument(
    hostile_stack: HostileStack, channel: grpc.aio.Channel
) -> None:
    body = with_bytes(gateway_pb2.StreamRunRequest(run_id=MARK), b"\xc3" * 12)
    call = channel.unary_stream(f"/{GATEWAY_SERVICE}/StreamRun")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call(body, metadata=hostile_stack.metadata(hostile_stack.key_a), timeout=10):
            pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value


async def test_a_truncated_message_is_invalid_argument(
    hostile_stack: HostileStack, channel: grpc.aio.Channel
) -> None:
    body = gateway_pb2.GetRunRequest(run_id="run_x").SerializeToString()[:-2]
    error = await call_raw(channel, "GetRun", body, hostile_stack.key_a)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"conversation_id": "conv-1\n"}, "conversation_id"),
        ({"event_id": "e-1\n"}, "event_id"),
        ({"conversation_id": "conv\x00"}, "conversation_id"),
        ({"channel": "chat\n"}, "channel"),
        ({"text": "hello\x00world"}, "text"),
    ],
)
async def test_hostile_send_message_fields_are_invalid_argument(
    hostile_stack: HostileStack, channel: grpc.aio.Channel, fields: dict[str, str], name: str
) -> None:
    before = await hostile_stack.row_counts()
    request = gateway_pb2.SendMessageRequest(
        **{"event_id": uid(), "conversation_id": "conv-1", "text": "hi", **fields}
    )
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    error = await refused(
        stub.SendMessage(request, metadata=hostile_stack.metadata(hostile_stack.key_a))
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert name in (error.details() or "")
    assert await hostile_stack.row_counts() == before


async def test_a_webhook_sender_with_a_trailing_newline_is_invalid_argument(
    hostile_stack: HostileStack, channel: grpc.aio.Channel
) -> None:
    before = await hostile_stack.row_counts()
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    messaging = admission_pb2.MessagingWebhookInput(
        provider="whatsapp",
        provider_event_id=uid(),
        thread_id="thread-1",
        sender_id="alice\n",
        text="hi",
    )
    error = await refused(
        stub.SubmitEvent(
            gateway_pb2.SubmitEventRequest(messaging=messaging),
            metadata=hostile_stack.metadata(hostile_stack.key_a),
        )
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "sender_id" in (error.details() or "")
    assert await hostile_stack.row_counts() == before


async def test_an_api_key_for_a_tenant_with_a_trailing_newline_is_refused(
    hostile_stack: HostileStack, channel: grpc.aio.Channel
) -> None:
    before = await hostile_stack.row_counts()
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    error = await refused(
        stub.CreateApiKey(
            gateway_pb2.CreateApiKeyRequest(tenant_id=f"t-{uid()}\n", principal_id="p"),
            metadata=hostile_stack.metadata(hostile_stack.admin_key),
        )
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "tenant_id" in (error.details() or "")
    assert await hostile_stack.row_counts() == before


async def test_a_run_id_with_a_nul_byte_is_invalid_argument(
    hostile_stack: HostileStack, channel: grpc.aio.Channel
) -> None:
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    error = await refused(
        stub.GetRun(
            gateway_pb2.GetRunRequest(run_id="run_\x00"),
            metadata=hostile_stack.metadata(hostile_stack.key_a),
        )
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "run_id" in (error.details() or "")


@pytest.mark.parametrize("reason", ["stop\x00now", "r" * 5000])
async def test_a_hostile_cancel_reason_is_refused_and_the_run_stays_queued(
    hostile_stack: HostileStack, channel: grpc.aio.Channel, reason: str
) -> None:
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    meta = hostile_stack.metadata(hostile_stack.key_a)
    sent = await stub.SendMessage(
        gateway_pb2.SendMessageRequest(event_id=uid(), conversation_id=f"c-{uid()}", text="hi"),
        metadata=meta,
    )
    before = await hostile_stack.row_counts()
    error = await refused(
        stub.CancelRun(
            gateway_pb2.CancelRunRequest(run_id=sent.run.run_id, reason=reason), metadata=meta
        )
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "reason" in (error.details() or "")
    assert await hostile_stack.row_counts() == before
    got = await stub.GetRun(gateway_pb2.GetRunRequest(run_id=sent.run.run_id), metadata=meta)
    assert got.run.status == common_pb2.RUN_STATUS_QUEUED


async def test_a_forged_page_token_is_invalid_argument(
    hostile_stack: HostileStack, channel: grpc.aio.Channel
) -> None:
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    meta = hostile_stack.metadata(hostile_stack.key_a)
    for inside in ("2024-01-01T00:00:00+00:00|run_\x00", "2024-01-01T00:00:00|run_x"):
        token = base64.urlsafe_b64encode(inside.encode()).decode()
        error = await refused(
            stub.ListRuns(gateway_pb2.ListRunsRequest(page_token=token), metadata=meta)
        )
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (inside, error)


async def test_an_unknown_status_number_is_invalid_argument(
    hostile_stack: HostileStack, channel: grpc.aio.Channel
) -> None:
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    error = await refused(
        stub.ListRuns(
            gateway_pb2.ListRunsRequest(statuses=[99]),  # type: ignore[list-item]
            metadata=hostile_stack.metadata(hostile_stack.key_a),
        )
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error


async def test_a_conversation_stream_with_a_nul_byte_is_invalid_argument(
    hostile_stack: HostileStack, channel: grpc.aio.Channel
) -> None:
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.StreamConversation(
            gateway_pb2.StreamConversationRequest(conversation_id="c\x00"),
            metadata=hostile_stack.metadata(hostile_stack.key_a),
            timeout=10,
        ):
            pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value


# -- HTTP ---------------------------------------------------------------------------------------


async def test_an_sse_cursor_beyond_int64_is_400_json(
    hostile_stack: HostileStack, http: httpx2.AsyncClient
) -> None:
    response = await http.get(
        "/v1/runs/run_x/events?after=99999999999999999999", headers=bearer(hostile_stack.key_a)
    )
    assert_json_error(response, 400, "INVALID_ARGUMENT")
    assert "after" in response.json()["error"]["message"]


async def test_a_page_size_beyond_int32_is_400_json(
    hostile_stack: HostileStack, http: httpx2.AsyncClient
) -> None:
    response = await http.get("/v1/runs?page_size=99999999999", headers=bearer(hostile_stack.key_a))
    assert_json_error(response, 400, "INVALID_ARGUMENT")
    assert "page_size" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "body",
    [
        b"{",
        b"\xff\xfe{}",
        b"[1, 2]",
        b'"text"',
        b"5",
        b'{"text": 5}',
        b'{"text": {"a": 1}}',
        b'{"text": "\\ud800", "event_id": "e1", "conversation_id": "c"}',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"nope": 1}',
    ],
)
async def test_a_malformed_json_body_is_400_json(
    hostile_stack: HostileStack, http: httpx2.AsyncClient, body: bytes
) -> None:
    before = await hostile_stack.row_counts()
    response = await http.post(
        "/v1/messages",
        content=body,
        headers={**bearer(hostile_stack.key_a), "Content-Type": "application/json"},
    )
    assert_json_error(response, 400, "INVALID_ARGUMENT")
    assert await hostile_stack.row_counts() == before


async def test_a_nul_byte_in_a_path_is_400_json(
    hostile_stack: HostileStack, http: httpx2.AsyncClient
) -> None:
    response = await http.get("/v1/runs/run_%00x", headers=bearer(hostile_stack.key_a))
    assert_json_error(response, 400, "INVALID_ARGUMENT")


async def test_unknown_routes_and_methods_answer_in_the_json_error_shape(
    hostile_stack: HostileStack, http: httpx2.AsyncClient
) -> None:
    assert_json_error(await http.get("/v1/nothing-here"), 404, "NOT_FOUND")
    assert_json_error(await http.delete("/v1/messages"), 405, "UNIMPLEMENTED")


async def test_an_oversized_body_answers_in_the_json_error_shape(
    hostile_stack: HostileStack, http: httpx2.AsyncClient
) -> None:
    body = json.dumps({"text": "x" * (2 << 20)}).encode()
    response = await http.post(
        "/v1/messages",
        content=body,
        headers={**bearer(hostile_stack.key_a), "Content-Type": "application/json"},
    )
    assert_json_error(response, 413, "INVALID_ARGUMENT")


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ('{"name": "nul\\u0000byte"}', "NUL"),
        ('{"name": "has space"}', "/name"),
        ('{"name": "a", "limits": {"max_steps": 1000000000000}}', "/limits/max_steps"),
        ('{"name": "a", "limits": {"max_steps": -1}}', "/limits/max_steps"),
        ('{"name": "a", "routes": [{"source": "carrier-pigeon"}]}', "/routes/0/source"),
        ('{"name": "a", "temperature": 2}', "temperature"),
        ('{"name": "a", "model": "no-price-9"}', "/model: model 'no-price-9' has no price"),
        ("name: a\ninstructions: !!python/object:os.system echo\n", "tag"),
        ("", "spec"),
    ],
)
async def test_a_hostile_agent_document_is_400_naming_what_and_writes_nothing(
    hostile_stack: HostileStack, http: httpx2.AsyncClient, spec: str, named: str
) -> None:
    before = await hostile_stack.row_counts()
    response = await http.post(
        "/v2/agents", json={"spec": spec}, headers=bearer(hostile_stack.admin_key)
    )
    assert_json_error(response, 400, "INVALID_ARGUMENT")
    assert named.lower() in response.text.lower(), response.text[:400]
    assert await hostile_stack.row_counts() == before


async def test_an_agent_name_outside_the_identifier_rules_is_invalid_argument(
    hostile_stack: HostileStack, channel: grpc.aio.Channel
) -> None:
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    meta = hostile_stack.metadata(hostile_stack.admin_key)
    for name in ("", "a/b", "x" * 129, "tab\there"):
        error = await refused(
            stub.RemoveAgent(gateway_pb2.RemoveAgentRequest(name=name), metadata=meta)
        )
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, error)
        assert "name" in (error.details() or ""), error


async def test_a_secret_refused_over_grpc_and_http_writes_nothing(
    hostile_stack: HostileStack, channel: grpc.aio.Channel, http: httpx2.AsyncClient
) -> None:
    before = await hostile_stack.row_counts()
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    meta = hostile_stack.metadata(hostile_stack.admin_key)
    for name, value in (("ok-name", ""), ("a/b", "v"), ("ok-name", "\x00v"), ("", "v")):
        error = await refused(
            stub.AddSecret(gateway_pb2.AddSecretRequest(name=name, value=value), metadata=meta)
        )
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, error)
    mangled = with_bytes(gateway_pb2.AddSecretRequest(name="n1", value=MARK), b"\xff" * 12)
    error = await call_raw(channel, "AddSecret", mangled, hostile_stack.admin_key)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    for body in ({"name": "n2", "value": 7}, {"name": "n3"}, {"name": "n4", "value": "v", "x": 1}):
        response = await http.post(
            "/v2/secrets", json=body, headers=bearer(hostile_stack.admin_key)
        )
        assert_json_error(response, 400, "INVALID_ARGUMENT")
    absent = await http.delete("/v2/secrets/never-was", headers=bearer(hostile_stack.admin_key))
    assert_json_error(absent, 404, "NOT_FOUND")
    no_scope = await http.get("/v2/secrets", headers=bearer(hostile_stack.key_a))
    assert_json_error(no_scope, 403, "PERMISSION_DENIED")
    assert await hostile_stack.row_counts() == before


async def test_a_channel_refused_over_grpc_and_http_writes_nothing(
    hostile_stack: HostileStack, channel: grpc.aio.Channel, http: httpx2.AsyncClient
) -> None:
    before = await hostile_stack.row_counts()
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    meta = hostile_stack.metadata(hostile_stack.admin_key)
    slack = interactions_pb2.ChannelSecrets(signing_secret="s" * 20, bot_token="b" * 20)
    for kind, name, agent, secrets in (
        ("telegram", "ok-name", "", slack),
        ("slack", "a/b", "", slack),
        ("slack", "ok\x00name", "", slack),
        ("slack", "ok-name", "no spaces", slack),
        ("slack", "ok-name", "", interactions_pb2.ChannelSecrets(signing_secret="s")),
        (
            "slack",
            "ok-name",
            "",
            interactions_pb2.ChannelSecrets(signing_secret="s\x00", bot_token="b"),
        ),
    ):
        request = gateway_pb2.AddChannelRequest(kind=kind, name=name, agent=agent, secrets=secrets)
        error = await refused(stub.AddChannel(request, metadata=meta))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (kind, name, error)
    for bad in ("/v2/channels/never-was", "/v2/channels/a%00b"):
        for answer in (
            await http.get(bad, headers=bearer(hostile_stack.admin_key)),
            await http.delete(bad, headers=bearer(hostile_stack.admin_key)),
        ):
            assert answer.status_code in (400, 404), answer.text
            assert answer.json()["error"]["status"] in ("INVALID_ARGUMENT", "NOT_FOUND")
    for body in (
        {"kind": "slack", "name": 7},
        {"kind": "webhook", "name": "w", "secrets": {"secret": "w" * 20},
         "settings": {"textField": "no-slash", "threadField": "/t", "senderField": "/s",
                      "eventIdField": "/e"}},
        {"kind": "slack", "name": "s", "x": 1},
    ):  # fmt: skip
        response = await http.post(
            "/v2/channels", json=body, headers=bearer(hostile_stack.admin_key)
        )
        assert_json_error(response, 400, "INVALID_ARGUMENT")
    rotate = await http.post(
        "/v2/channels/never-was/rotate-secret",
        json={"secret": "x", "graceSeconds": -1},
        headers=bearer(hostile_stack.admin_key),
    )
    assert_json_error(rotate, 400, "INVALID_ARGUMENT")
    no_scope = await http.get("/v2/channels", headers=bearer(hostile_stack.key_a))
    assert_json_error(no_scope, 403, "PERMISSION_DENIED")
    assert await hostile_stack.row_counts() == before
