"""An agent's MCP server as durable, gated tools, end to end: real services, the worker as a
process, and the local MCP server (tether.testing.mcp_server) it calls over streamable HTTP.

Each MCP call takes the one tool path: the schema refuses a bad input before any gate, a
destructive tool waits for an approval and runs its stored input once, the idempotency key rides
in `_meta` so a worker killed mid-call re-sends it and the server executes once, a server
restarted mid-run is re-initialised, a cancel reaches the server as `notifications/cancelled`,
and a bearer secret from the secret store never appears in a log line."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx2
import pytest
import pytest_asyncio

from tests.system.execution_support import (
    ExecStack,
    Tenant,
    events_of,
    exec_stack,
    parts_of,
    run_row,
    wait_for_status,
)
from tests.system.streaming_support import prompt
from tests.system.test_agents import AGENT_SCOPES
from tests.system.test_tool_package import apply
from tether import apikeys
from tether.runtime.rpc import internal_channel
from tether.testing.mcp_server import McpServer
from tether.testing.model_server import TextTurn, ToolUseTurn
from tether.v1 import gateway_pb2, gateway_pb2_grpc, interactions_pb2, interactions_pb2_grpc

pytestmark = pytest.mark.slow

BEARER = "mcp-bearer-" + secrets.token_hex(16)
SCOPES = (*AGENT_SCOPES, apikeys.SECRETS_READ, apikeys.SECRETS_WRITE)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def mcp() -> AsyncIterator[McpServer]:
    server = McpServer()
    await server.start()
    try:
        yield server
    finally:
        server.release_slow()
        await server.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def locked() -> AsyncIterator[McpServer]:
    server = McpServer(auth={"bearer": BEARER})
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ExecStack]:
    run_dir = Path(tmp_path_factory.mktemp("mcp-tools"))
    env = {"TETHER_ALLOW_PRIVATE_TARGETS": "loopback", "TETHER_WORKER_MCP_CALL_TIMEOUT_S": "20"}
    async with exec_stack(
        pg_server_url, template_db, redis_url, run_dir, workers=1, extra_env=env
    ) as running:
        yield running


@pytest_asyncio.fixture(loop_scope="session")
async def fresh(mcp: McpServer) -> McpServer:
    mcp.reset()
    return mcp


def shop(url: str, **extra: Any) -> dict[str, Any]:
    """An agent using the stand-in's four tools; the slow one overridden to `read`."""
    return {
        "name": "shop",
        "instructions": "Help with orders.",
        "mcp_servers": [
            {
                "name": "shop",
                "url": url,
                "transport": "streamable-http",
                "tools": ["lookup_order", "cancel_order", "slow_report"],
                "risk": {"slow_report": "read"},
                **extra,
            }
        ],
    }


async def shop_tenant(
    stack: ExecStack, url: str, grant: tuple[str, ...] = (), **extra: Any
) -> Tenant:
    tenant = await stack.tenant(scopes=SCOPES, grant=grant)
    await apply(tenant, shop(url, **extra))
    return tenant


async def tool_results(stack: ExecStack, run_id: str) -> list[dict[str, Any]]:
    return [
        dict(p.payload) for p in await parts_of(stack.db_url, run_id) if p.kind == "tool_result"
    ]


async def decide(tenant: Tenant, run_id: str, decision: str) -> gateway_pb2.DecideApprovalResponse:
    async with grpc.aio.insecure_channel(tenant.stack.addr("gateway")) as channel:
        decided: gateway_pb2.DecideApprovalResponse = await gateway_pb2_grpc.GatewayServiceStub(
            channel
        ).DecideApproval(
            gateway_pb2.DecideApprovalRequest(run_id=run_id, decision=decision),
            metadata=tenant.metadata,
        )
    return decided


async def test_a_read_call_is_offered_sorted_refused_by_its_schema_then_runs_once(
    stack: ExecStack, fresh: McpServer
) -> None:
    # `gone` is allowlisted but the server lists no such tool: left out, said on the run.
    tools = ["lookup_order", "cancel_order", "slow_report", "gone"]
    tenant = await shop_tenant(stack, fresh.url, tools=tools)
    text = prompt("mcp read")
    stack.model.script(
        text,
        [
            ToolUseTurn("shop__lookup_order", {"order": "A-1001"}),
            ToolUseTurn("shop__lookup_order", {"order_id": "A-1001"}),
            TextTurn("It shipped."),
        ],
    )
    run_id = await tenant.send(text)
    run = await wait_for_status(stack.db_url, run_id, "completed")
    refused, looked = await tool_results(stack, run_id)
    assert refused.get("isError") is True
    assert "input.order_id: is required" in refused["content"], refused
    assert not looked.get("isError", False), looked
    assert json.loads(looked["content"])["status"] == "shipped"
    assert fresh.ledger.executions == {"lookup_order": 1}, "the refused call never left"
    (key,) = fresh.ledger.executions_by_key  # the call carried its idempotency key in _meta
    bodies = [r.body for r in stack.model.requests if r.script_key == text]
    names = [t["name"] for t in bodies[0]["tools"]]
    # The built-in tools first, then the server's, sorted: the same bytes at every turn.
    assert names[-3:] == ["shop__cancel_order", "shop__lookup_order", "shop__slow_report"]
    assert not any(n.startswith("shop__") for n in names[:-3])
    assert len({json.dumps(b["tools"]) for b in bodies}) == 1
    assert run.result_text == "It shipped."
    assert list(run.warnings) == ["mcp_tool_omitted:shop__gone"]
    assert key


async def test_a_render_offers_the_servers_tools_a_run_would_and_names_what_it_cannot_list(
    stack: ExecStack, fresh: McpServer, locked: McpServer
) -> None:
    tenant = await stack.tenant(scopes=SCOPES)
    agent = shop(fresh.url, tools=["lookup_order", "cancel_order", "gone"], risk={})
    agent["mcp_servers"].append(
        {"name": "vault", "url": locked.url, "auth": {"bearer": "vault-token"}, "tools": ["x"]}
    )
    await apply(tenant, agent)
    text = prompt("mcp render")
    async with grpc.aio.insecure_channel(stack.addr("gateway")) as channel:
        rendered = await gateway_pb2_grpc.GatewayServiceStub(channel).RenderAgent(
            gateway_pb2.RenderAgentRequest(name="shop", message=text), metadata=tenant.metadata
        )
    request = json.loads(rendered.request_json)
    names = [t["name"] for t in request["tools"]]
    # As a run's first request offers them: after the built-in tools, sorted.
    assert names[-2:] == ["shop__cancel_order", "shop__lookup_order"], names
    lookup = next(t for t in request["tools"] if t["name"] == "shop__lookup_order")
    assert lookup["input_schema"]["required"] == ["order_id"]
    # The bearer server is not asked (its secret is revealed only to a leased run).
    assert list(rendered.warnings) == ["mcp_tool_omitted:shop__gone", "mcp_server_omitted:vault"]
    assert locked.ledger.initializations == 0
    assert fresh.ledger.executions == {}
    assert not [r for r in stack.model.requests if r.script_key == text], "no model call"


async def test_a_destructive_call_waits_for_approval_and_runs_the_stored_input_once(
    stack: ExecStack, fresh: McpServer
) -> None:
    tenant = await shop_tenant(stack, fresh.url)
    text = prompt("mcp cancel")
    stack.model.script(
        text, [ToolUseTurn("shop__cancel_order", {"order_id": "A-1002"}), TextTurn("Cancelled.")]
    )
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "waiting-for-approval")
    assert fresh.ledger.executions == {}, "nothing runs before the approval"
    requested = [
        p for _, t, p in await events_of(stack.db_url, run_id) if t == "approval.requested"
    ]
    assert requested, "the pause is an approval"
    await decide(tenant, run_id, "allow-once")
    await wait_for_status(stack.db_url, run_id, "completed")
    (result,) = await tool_results(stack, run_id)
    assert not result.get("isError", False), result
    assert fresh.ledger.executions == {"cancel_order": 1}
    assert fresh.ledger.orders["A-1002"]["status"] == "cancelled"


async def test_a_server_restarted_mid_run_is_reinitialised_and_the_run_completes(
    stack: ExecStack, fresh: McpServer
) -> None:
    tenant = await shop_tenant(stack, fresh.url)
    text = prompt("mcp restart")
    stack.model.script(
        text,
        [
            ToolUseTurn("shop__lookup_order", {"order_id": "A-1001"}),
            ToolUseTurn("shop__cancel_order", {"order_id": "A-1001"}),
            TextTurn("Done."),
        ],
    )
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "waiting-for-approval")
    before = fresh.ledger.initializations
    await fresh.restart()  # every session the worker holds is gone; the run is mid-way
    await decide(tenant, run_id, "allow-once")
    await wait_for_status(stack.db_url, run_id, "completed")
    looked, cancelled = await tool_results(stack, run_id)
    assert not looked.get("isError", False) and not cancelled.get("isError", False), cancelled
    assert fresh.ledger.executions == {"lookup_order": 1, "cancel_order": 1}
    assert fresh.ledger.initializations > before, "a new session was initialised"


async def test_a_cancel_during_a_slow_call_reaches_the_server(
    stack: ExecStack, fresh: McpServer
) -> None:
    tenant = await shop_tenant(stack, fresh.url)
    text = prompt("mcp slow cancel")
    stack.model.script(
        text, [ToolUseTurn("shop__slow_report", {"topic": "q3"}), TextTurn("never reached")]
    )
    run_id = await tenant.send(text)
    await fresh.wait_until(lambda ledger: ledger.slow_started == 1)
    assert (await tenant.cancel(run_id)).changed
    await wait_for_status(stack.db_url, run_id, "cancelled")
    await fresh.wait_until(lambda ledger: len(ledger.cancel_notifications) == 1)
    await fresh.wait_until(lambda ledger: ledger.slow_interrupted == 1)


async def test_a_bearer_secret_is_sent_and_never_logged(
    stack: ExecStack, locked: McpServer, tmp_path: Path
) -> None:
    tenant = await shop_tenant(
        stack, locked.url, auth={"bearer": "shop-token"}, tools=["lookup_order"], risk={}
    )
    base = f"http://{stack.services.http_addresses()['gateway']}"
    async with httpx2.AsyncClient(base_url=base) as http:
        added = await http.post(
            "/v2/secrets",
            json={"name": "shop-token", "value": BEARER},
            headers={"Authorization": f"Bearer {tenant.api_key}"},
        )
        assert added.status_code in (200, 201), added.text
    text = prompt("mcp bearer")
    stack.model.script(
        text, [ToolUseTurn("shop__lookup_order", {"order_id": "A-1002"}), TextTurn("Packing.")]
    )
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "completed")
    (result,) = await tool_results(stack, run_id)
    assert json.loads(result["content"])["status"] == "processing", result
    assert locked.ledger.executions == {"lookup_order": 1}
    logs = list(stack.services.run_dir.glob("*.log"))
    assert logs
    for log in logs:
        assert BEARER not in log.read_text(errors="replace"), f"{log.name} logged the token"
    assert all(BEARER not in json.dumps(r.body) for r in stack.model.requests)


async def test_a_worker_killed_mid_call_resends_the_same_key_and_the_server_runs_it_once(
    stack: ExecStack, fresh: McpServer
) -> None:
    # An effect (its risk overridden to publish), run under a standing grant: the call is
    # durable before it fires, and its record stays open when the worker dies under it.
    tenant = await shop_tenant(
        stack, fresh.url, grant=("shop__slow_report",), risk={"slow_report": "publish"}
    )
    text = prompt("mcp kill")
    stack.model.script(
        text,
        [
            ToolUseTurn("shop__slow_report", {"topic": "q4"}),
            # The retried attempt finds the call interrupted; the model calls it again, with the
            # same input: the same idempotency key.
            ToolUseTurn("shop__slow_report", {"topic": "q4"}),
            TextTurn("Reported."),
        ],
    )
    doomed = [n for n in stack.services.procs if n.startswith("worker")]
    run_id = await tenant.send(text)
    await fresh.wait_until(lambda ledger: ledger.slow_started == 1)
    for name in doomed:
        stack.services.kill(name)
    await stack.start_worker()

    # Released after the kill: the first execution (its caller gone) finishes and stores its
    # answer under the key; the retried attempt's call, under the same key, gets that answer.
    fresh.release_slow()
    await wait_for_status(stack.db_url, run_id, "completed", timeout=30)
    interrupted, result = await tool_results(stack, run_id)
    assert interrupted["content"].startswith("interrupted"), interrupted
    assert result["content"] == "report on q4", result
    assert fresh.ledger.executions == {"slow_report": 1}, "one execution under one key"
    assert list(fresh.ledger.replays.values()) == [1], "the retry got the stored answer"


async def test_a_leased_worker_is_revealed_only_the_secrets_its_runs_agent_names(
    stack: ExecStack, fresh: McpServer
) -> None:
    # The run's agent names `shop-token` as its MCP server's bearer; the tenant also keeps a
    # channel's bot token. A worker holding the run's live lease gets the first, and the second
    # is NOT_FOUND, exactly like a secret that does not exist: a lease is a grant to run this
    # agent, not a key to the tenant's whole secret store.
    tenant = await shop_tenant(
        stack, fresh.url, auth={"bearer": "shop-token"}, tools=["slow_report"]
    )
    base = f"http://{stack.services.http_addresses()['gateway']}"
    async with httpx2.AsyncClient(base_url=base) as http:
        for name, value in (("shop-token", BEARER), ("bot-token", "xoxb-not-for-this-agent")):
            added = await http.post(
                "/v2/secrets",
                json={"name": name, "value": value},
                headers={"Authorization": f"Bearer {tenant.api_key}"},
            )
            assert added.status_code in (200, 201), added.text
    text = prompt("mcp secret scope")
    stack.model.script(
        text, [ToolUseTurn("shop__slow_report", {"topic": "q1"}), TextTurn("Reported.")]
    )
    run_id = await tenant.send(text)
    await fresh.wait_until(lambda ledger: ledger.slow_started == 1)
    epoch = (await run_row(stack.db_url, run_id)).lease_epoch
    async with internal_channel(stack.addr("interactions"), stack.credentials["worker"]) as ch:
        stub = interactions_pb2_grpc.InteractionsServiceStub(ch)
        named = await stub.RevealRunSecret(
            interactions_pb2.RevealRunSecretRequest(run_id=run_id, epoch=epoch, name="shop-token")
        )
        with pytest.raises(grpc.aio.AioRpcError) as other:
            await stub.RevealRunSecret(
                interactions_pb2.RevealRunSecretRequest(
                    run_id=run_id, epoch=epoch, name="bot-token"
                )
            )
        with pytest.raises(grpc.aio.AioRpcError) as absent:
            await stub.RevealRunSecret(
                interactions_pb2.RevealRunSecretRequest(run_id=run_id, epoch=epoch, name="nope")
            )
    fresh.release_slow()
    await wait_for_status(stack.db_url, run_id, "completed", timeout=30)
    assert bytes(named.value).decode() == BEARER
    assert other.value.code() == absent.value.code() == grpc.StatusCode.NOT_FOUND
    assert other.value.details() == absent.value.details().replace("nope", "bot-token")
    assert "xoxb" not in (other.value.details() or "")


async def test_a_secret_is_revealed_only_to_a_worker_under_the_runs_live_lease(
    stack: ExecStack,
) -> None:
    absent = "run_" + "0" * 32
    ask = interactions_pb2.RevealRunSecretRequest(run_id=absent, epoch=1, name="shop-token")
    codes = {}
    for caller in ("gateway", "worker"):
        async with internal_channel(stack.addr("interactions"), stack.credentials[caller]) as ch:
            stub = interactions_pb2_grpc.InteractionsServiceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.RevealRunSecret(ask)
            codes[caller] = refused.value.code()
            if caller == "worker":
                with pytest.raises(grpc.aio.AioRpcError) as nameless:
                    await stub.RevealRunSecret(
                        interactions_pb2.RevealRunSecretRequest(run_id=absent, epoch=1)
                    )
    assert codes == {
        "gateway": grpc.StatusCode.PERMISSION_DENIED,
        "worker": grpc.StatusCode.FAILED_PRECONDITION,  # no live lease of that run
    }
    assert nameless.value.code() == grpc.StatusCode.INVALID_ARGUMENT
