"""The Python client's outage retries over real gRPC, against a gateway that answers
UNAVAILABLE a few times: idempotent calls are repeated (a send with the same event id), the
others never are, and the retrying is bounded."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio

from tether.client import TetherClient
from tether.v1 import gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="session")


class FlakyGateway(gateway_pb2_grpc.GatewayServiceServicer):
    """Answers UNAVAILABLE to the first `failures` calls of each method, then succeeds."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: dict[str, list[Any]] = {}

    async def _answer(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> None:
        seen = self.calls.setdefault(method, [])
        seen.append(request)
        if len(seen) <= self.failures:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "PostgreSQL is unreachable")

    async def SendMessage(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._answer("SendMessage", request, context)
        return gateway_pb2.SendMessageResponse()

    async def GetRun(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._answer("GetRun", request, context)
        return gateway_pb2.GetRunResponse()

    async def CreateApiKey(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._answer("CreateApiKey", request, context)
        return gateway_pb2.CreateApiKeyResponse()

    async def DecideApproval(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._answer("DecideApproval", request, context)
        return gateway_pb2.DecideApprovalResponse()


@pytest_asyncio.fixture(loop_scope="session")
async def flaky() -> AsyncIterator[tuple[FlakyGateway, str]]:
    gateway = FlakyGateway(failures=3)
    server = grpc.aio.server()
    gateway_pb2_grpc.add_GatewayServiceServicer_to_server(gateway, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield gateway, f"127.0.0.1:{port}"
    await server.stop(0)


async def test_a_send_and_a_read_are_retried_with_the_same_event_id(
    flaky: tuple[FlakyGateway, str],
) -> None:
    gateway, address = flaky
    async with TetherClient(address, "tk_test") as client:
        await client.send("hi", conversation_id="c", event_id="e-1")
        await client.get_run("run_1")
    sends = gateway.calls["SendMessage"]
    assert [r.event_id for r in sends] == ["e-1"] * 4, "three refusals, then the same send"
    assert len(gateway.calls["GetRun"]) == 4


async def test_calls_that_are_not_safe_to_repeat_are_never_retried(
    flaky: tuple[FlakyGateway, str],
) -> None:
    gateway, address = flaky
    async with TetherClient(address, "tk_test") as client:
        for call in (
            client.create_key("t", "p"),
            client.decide("run_1", "allow-once"),
            client.send("hi", conversation_id="c", event_id=""),  # no id: a repeat is new
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert [len(gateway.calls[m]) for m in ("CreateApiKey", "DecideApproval", "SendMessage")] == [
        1,
        1,
        1,
    ]


async def test_retrying_gives_up_after_its_bound(flaky: tuple[FlakyGateway, str]) -> None:
    gateway, address = flaky
    gateway.failures = 1_000_000
    async with TetherClient(address, "tk_test", retry_for_s=0.5) as client:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.get_run("run_1")
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert 2 <= len(gateway.calls["GetRun"]) <= 4, "0.2 s, then 0.4 s: past the bound"
