"""Render without spending, with the services as processes: `tether agents render` (CLI, HTTP v2
and gRPC) returns the request a worker builds for a message in a new conversation, the same one
a run's first model call sends, naming the agent the routes pick, while the model server hears
nothing and no run is created; another tenant's agent is NOT_FOUND; with no worker connected
the answer is UNAVAILABLE."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import pytest_asyncio
from sqlalchemy import text

from tests.system.execution_support import ExecStack, Tenant, exec_stack
from tests.system.streaming_support import prompt
from tests.system.test_agents import (
    AGENT_SCOPES,
    bearer,
    cli_json,
    document,
    http_base,
    send,
    stack_file,
)
from tether.db.engine import create_engine
from tether.testing.eventually import eventually
from tether.v1 import gateway_pb2, gateway_pb2_grpc

TIME_FACT = re.compile(r"time: [^\\]*")
# What a request carries that the render shows (the recorded call adds `stream`).
REQUEST_KEYS = ("model", "max_tokens", "system", "tools", "messages")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ExecStack]:
    async with exec_stack(
        pg_server_url,
        template_db,
        redis_url,
        Path(tmp_path_factory.mktemp("agent-render")),
        workers=1,
    ) as running:
        yield running


async def two_agents(stack: ExecStack, directory: Path) -> tuple[Tenant, str]:
    """A tenant with helper (the default, get_time) and support (routed from whatsapp,
    publish_post), and a stack file for its key."""
    tenant = await stack.tenant(scopes=AGENT_SCOPES)
    file = stack_file(stack, tenant.api_key, directory)
    helper = directory / "helper.json"
    helper.write_text(document("helper", "You are Helper, brief and exact.", ["get_time"]))
    support = directory / "support.json"
    support.write_text(
        document(
            "support",
            "You are Support, answering on WhatsApp.",
            ["publish_post"],
            routes=[{"channel": "whatsapp"}],
        )
    )
    for path in (helper, support):
        await cli_json("agents", "apply", str(path), "--stack", file)
    return tenant, file


async def run_count(stack: ExecStack, tenant_id: str) -> int:
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            found = await conn.execute(
                text("SELECT count(*) FROM runs WHERE tenant_id = :t"), {"t": tenant_id}
            )
            return int(found.scalar_one())
    finally:
        await engine.dispose()


async def grpc_render(tenant: Tenant, name: str, message: str) -> gateway_pb2.RenderAgentResponse:
    async with grpc.aio.insecure_channel(tenant.stack.addr("gateway")) as channel:
        response: gateway_pb2.RenderAgentResponse = await gateway_pb2_grpc.GatewayServiceStub(
            channel
        ).RenderAgent(
            gateway_pb2.RenderAgentRequest(name=name, message=message), metadata=tenant.metadata
        )
    return response


def same_but_the_clock(request: dict[str, Any]) -> str:
    """The request as JSON with its live `time` fact blanked: the render and the run read the
    clock a moment apart (the minute may turn between them)."""
    return TIME_FACT.sub("time: -", json.dumps(request, sort_keys=True))


def tool_names(request: dict[str, Any]) -> set[str]:
    return {tool["name"] for tool in request.get("tools", [])}


async def test_render_is_the_routed_agents_first_request_with_no_model_call_and_no_run(
    stack: ExecStack, tmp_path: Path
) -> None:
    tenant, file = await two_agents(stack, tmp_path)
    message = prompt("render me")
    heard_before = len(stack.model.requests)
    runs_before = await run_count(stack, tenant.tenant_id)

    (support,) = await cli_json(
        "agents", "render", "support", "--message", message, "--source", "chat",
        "--channel", "whatsapp", "--stack", file,
    )  # fmt: skip
    assert (support["agent"], support["version"]) == ("support", 1)
    assert (support["routed_agent"], support["routed_version"]) == ("support", 1)
    assert "You are Support" in json.dumps(support["system"])
    assert support["system"][-1]["cache_control"]["type"] == "ephemeral"
    assert tool_names(support) == {"publish_post"}
    assert support["messages"][-1]["content"][-1]["text"] == message
    assert support["estimated_input_tokens"] > 0
    assert support["estimated_cost_usd"] > 0

    # The default agent rendered for a whatsapp message: its own instructions and tools, and
    # the routes name support as the agent such a run would get.
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{http_base(stack)}/v2/agents/helper/render",
            json={"message": message, "source": "chat", "channel": "whatsapp"},
            headers=bearer(tenant.api_key),
        ) as response,
    ):
        assert response.status == 200, await response.text()
        helper = await response.json()
    assert (helper["agent"], helper["version"]) == ("helper", 1)
    assert (helper["routedAgent"], helper["routedVersion"]) == ("support", 1)
    helper_request = json.loads(helper["requestJson"])
    assert "You are Helper" in json.dumps(helper_request["system"])
    assert "You are Support" not in json.dumps(helper_request["system"])
    assert tool_names(helper_request) == {"get_time"}

    assert len(stack.model.requests) == heard_before, "a render called the model"
    assert await run_count(stack, tenant.tenant_id) == runs_before, "a render created a run"

    # The render is the request a run's first model call sends for that message.
    await send(tenant, message, "whatsapp")
    sent = next(r.body for r in stack.model.requests if r.script_key == message)
    rendered = {key: support[key] for key in REQUEST_KEYS}
    assert same_but_the_clock(rendered) == same_but_the_clock(
        {key: sent.get(key) for key in REQUEST_KEYS}
    )


async def test_another_tenants_agent_renders_as_not_found(stack: ExecStack, tmp_path: Path) -> None:
    owner, _ = await two_agents(stack, tmp_path)
    other = await stack.tenant(scopes=AGENT_SCOPES)
    with pytest.raises(grpc.aio.AioRpcError) as foreign:
        await grpc_render(other, "support", "hello")
    with pytest.raises(grpc.aio.AioRpcError) as absent:
        await grpc_render(other, "nobody", "hello")
    assert foreign.value.code() == absent.value.code() == grpc.StatusCode.NOT_FOUND
    assert "support" in str(foreign.value.details())
    assert (await grpc_render(owner, "support", "hello")).agent == "support"


async def test_with_no_worker_connected_a_render_is_unavailable(
    stack: ExecStack, tmp_path: Path
) -> None:
    tenant, _ = await two_agents(stack, tmp_path)
    await stack.services.stop("worker", grace=5)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await grpc_render(tenant, "support", "hello")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no worker is connected" in str(refused.value.details())
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                f"{http_base(stack)}/v2/agents/support/render",
                json={"message": "hello"},
                headers=bearer(tenant.api_key),
            ) as response,
        ):
            assert response.status == 503, await response.text()
            assert (await response.json())["error"]["status"] == "UNAVAILABLE"
    finally:
        await stack.start_worker()

    async def rendered() -> gateway_pb2.RenderAgentResponse | None:
        try:
            return await grpc_render(tenant, "support", "hello")
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            return None

    # The new worker's Work stream connects after it reports ready.
    assert (await eventually(rendered, what="a render by the new worker")).agent == "support"
