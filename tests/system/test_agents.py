"""A tenant's agents with the services as processes, through the CLI and HTTP v2: two agents
routed by channel, each run's model request carrying its own agent's instructions and tools; an
identical apply creates nothing; a conditional apply on a stale base is refused and changes
nothing, as is a rollback on one; a rollback routes the next run to the old version; another
tenant's agent is NOT_FOUND like an absent one; a key without agents:write is PERMISSION_DENIED and
changes nothing; the operator acts within a tenant it names and mints its first agents key."""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import pytest_asyncio
from sqlalchemy import select

from services.worker.tools.demo import PublishPost
from tests.system.execution_support import ExecStack, Tenant, exec_stack, wait_for_status
from tests.system.streaming_support import prompt
from tether import agent_spec, apikeys, credentials
from tether.db.engine import create_engine
from tether.db.schema import tool_catalog
from tether.domain import schema_sha256
from tether.testing.eventually import eventually
from tether.testing.model_server import TextTurn
from tether.v1 import gateway_pb2, gateway_pb2_grpc

AGENT_SCOPES = (*apikeys.CLIENT_SCOPES, apikeys.AGENTS_READ, apikeys.AGENTS_WRITE)
OPERATOR = "top_" + secrets.token_urlsafe(32)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ExecStack]:
    async with exec_stack(
        pg_server_url,
        template_db,
        redis_url,
        Path(tmp_path_factory.mktemp("agents")),
        workers=1,
        extra_env={"TETHER_GATEWAY_OPERATOR_CREDENTIAL_SHA256": credentials.verifier(OPERATOR)},
    ) as running:
        # An apply naming tools needs the catalog the worker's hello fills.
        await eventually(lambda: catalog(running), what="the worker's tools in the catalog")
        yield running


async def catalog(stack: ExecStack) -> list[Any]:
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            return list(await conn.execute(select(tool_catalog).order_by(tool_catalog.c.name)))
    finally:
        await engine.dispose()


def document(name: str, instructions: str, tools: list[str], **more: Any) -> str:
    return json.dumps({"name": name, "instructions": instructions, "tools": tools, **more})


def stack_file(stack: ExecStack, key: str, directory: Path, **more: str) -> str:
    path = directory / f"stack-{uuid.uuid4().hex[:6]}.json"
    path.write_text(json.dumps({"gateway": stack.addr("gateway"), "api_key": key, **more}))
    return str(path)


async def tether(*args: str, stdin: str = "") -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tether.cli",
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(stdin.encode()), 60)
    assert process.returncode is not None
    return process.returncode, out.decode() + err.decode()


async def cli_json(*args: str, stdin: str = "") -> list[dict[str, Any]]:
    code, out = await tether(*args, "--json", stdin=stdin)
    assert code == 0, out
    return [json.loads(line) for line in out.splitlines()]


async def send(tenant: Tenant, text: str, channel: str) -> str:
    tenant.stack.model.script(text, [TextTurn("done")])
    async with grpc.aio.insecure_channel(tenant.stack.addr("gateway")) as channel_:
        response = await gateway_pb2_grpc.GatewayServiceStub(channel_).SendMessage(
            gateway_pb2.SendMessageRequest(
                text=text,
                conversation_id=f"c-{uuid.uuid4().hex[:8]}",
                event_id=f"e-{uuid.uuid4().hex}",
                channel=channel,
            ),
            metadata=tenant.metadata,
        )
    run_id = str(response.run.run_id)
    await wait_for_status(tenant.stack.db_url, run_id, "completed")
    return run_id


def model_request(stack: ExecStack, text: str) -> tuple[str, set[str]]:
    """The system prompt (as JSON text) and tool names of the run's first model request."""
    body = next(r.body for r in stack.model.requests if r.script_key == text)
    return json.dumps(body.get("system", "")), {tool["name"] for tool in body.get("tools", [])}


async def pinned(tenant: Tenant, run_id: str) -> tuple[str, int]:
    """The agent and version the run's routing names, as GetRun shows it."""
    async with grpc.aio.insecure_channel(tenant.stack.addr("gateway")) as channel:
        response = await gateway_pb2_grpc.GatewayServiceStub(channel).GetRun(
            gateway_pb2.GetRunRequest(run_id=run_id), metadata=tenant.metadata
        )
    return response.run.routing.agent, response.run.routing.agent_version


def http_base(stack: ExecStack) -> str:
    return f"http://{stack.services.http_addresses()['gateway']}"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_agents_route_by_channel_apply_conditionally_and_roll_back(
    stack: ExecStack, tmp_path: Path
) -> None:
    tenant = await stack.tenant(scopes=AGENT_SCOPES)
    file = stack_file(stack, tenant.api_key, tmp_path)
    helper = tmp_path / "helper.json"
    helper.write_text(document("helper", "You are Helper, brief and exact.", ["get_time"]))
    support = tmp_path / "support.yaml"
    support.write_text(
        "name: support\n"
        "instructions: You are Support, answering on WhatsApp.\n"
        "tools: [publish_post]\n"
        "routes:\n  - channel: whatsapp\n"
    )
    assert await cli_json("agents", "apply", str(helper), "--stack", file) == [
        {"name": "helper", "version": 1, "created": True}
    ]
    assert await cli_json("agents", "apply", str(support), "--stack", file) == [
        {"name": "support", "version": 1, "created": True}
    ]
    listed = await cli_json("agents", "list", "--stack", file)
    assert [(a["name"], a["published_version"], a["default"]) for a in listed] == [
        ("helper", 1, True),
        ("support", 1, False),
    ]

    chat_text, whatsapp_text = prompt("to helper"), prompt("to support")
    chat_run = await send(tenant, chat_text, "")
    whatsapp_run = await send(tenant, whatsapp_text, "whatsapp")
    system, tools = model_request(stack, chat_text)
    assert "You are Helper" in system and "You are Support" not in system
    assert "get_time" in tools and "publish_post" not in tools
    system, tools = model_request(stack, whatsapp_text)
    assert "You are Support" in system and "You are Helper" not in system
    assert "publish_post" in tools and "get_time" not in tools
    assert await pinned(tenant, chat_run) == ("helper", 1)
    assert await pinned(tenant, whatsapp_run) == ("support", 1)
    (shown_run,) = await cli_json("run", whatsapp_run, "--parts", "0", "--stack", file)
    assert shown_run["routing"]["agent"] == "support"
    assert shown_run["routing"]["agent_version"] == 1

    # An identical apply creates nothing.
    assert await cli_json("agents", "apply", str(helper), "--stack", file) == [
        {"name": "helper", "version": 1, "created": False}
    ]
    # A second version, then a conditional apply on the stale base: 409 ABORTED, nothing new.
    helper.write_text(document("helper", "You are Helper v2, chatty.", ["get_time"]))
    code, out = await tether("agents", "apply", str(helper), "--base-version", "1", "--stack", file)
    assert code == 0 and "agent helper created version 2" in out, out
    stale = document("helper", "You are Helper v3.", ["get_time"])
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{http_base(stack)}/v2/agents",
            json={"spec": stale, "baseVersion": 1},
            headers=bearer(tenant.api_key),
        ) as response,
    ):
        assert response.status == 409, await response.text()
        assert (await response.json())["error"]["status"] == "ABORTED"
    versions = await cli_json("agents", "versions", "helper", "--stack", file)
    assert [v["version"] for v in versions] == [1, 2]
    shown = await cli_json("agents", "show", "helper", "--stack", file)
    assert (shown[0]["version"], shown[0]["published_version"], shown[0]["default"]) == (2, 2, True)
    assert "Helper v2" in shown[0]["spec"]

    (diff,) = await cli_json("agents", "diff", "helper", "1", "2", "--stack", file)
    assert '-  "instructions": "You are Helper, brief and exact."' in diff["diff"]
    assert '+  "instructions": "You are Helper v2, chatty."' in diff["diff"]

    v2_text = prompt("helper v2")
    v2_run = await send(tenant, v2_text, "")
    assert "Helper v2" in model_request(stack, v2_text)[0]
    assert await pinned(tenant, v2_run) == ("helper", 2)

    # A rollback routes the next run to the old version; the run before keeps its own.
    assert await cli_json("agents", "rollback", "helper", "--to", "1", "--stack", file) == [
        {"name": "helper", "version": 1}
    ]
    back_text = prompt("helper back")
    back_run = await send(tenant, back_text, "")
    system, _ = model_request(stack, back_text)
    assert "You are Helper, brief" in system and "Helper v2" not in system
    assert await pinned(tenant, back_run) == ("helper", 1)
    assert await pinned(tenant, v2_run) == ("helper", 2)

    # The default cannot be removed; once another is the default it takes the unrouted runs,
    # and the old one can go (none of its runs is unfinished).
    code, out = await tether("agents", "rm", "helper", "--stack", file)
    assert code == 1 and "FAILED_PRECONDITION" in out and "default" in out, out
    assert await cli_json("agents", "default", "support", "--stack", file) == [
        {"name": "support", "default": True}
    ]
    unrouted_run = await send(tenant, prompt("to the new default"), "")
    assert await pinned(tenant, unrouted_run) == ("support", 1)
    assert await cli_json("agents", "rm", "helper", "--stack", file) == [
        {"name": "helper", "version": 1, "removed": True}
    ]
    code, out = await tether("agents", "show", "helper", "--stack", file)
    assert code == 1 and "error: NOT_FOUND: " in out, out
    assert [a["name"] for a in await cli_json("agents", "list", "--stack", file)] == ["support"]


async def test_http_serves_the_schema_reads_and_refuses_an_invalid_document(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant(scopes=AGENT_SCOPES)
    base, headers = http_base(stack), bearer(tenant.api_key)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{base}/v2/agents/schema") as response:
            assert response.status == 200
            assert await response.json() == agent_spec.schema()
        spec = document("writer", "Write.", ["get_time"])
        async with http.post(f"{base}/v2/agents", json={"spec": spec}, headers=headers) as r:
            assert r.status == 201, await r.text()
            assert await r.json() == {"name": "writer", "version": 1, "created": True}
        async with http.post(f"{base}/v2/agents", json={"spec": spec}, headers=headers) as r:
            assert r.status == 200 and await r.json() == {"name": "writer", "version": 1}
        async with http.get(f"{base}/v2/agents/writer?version=1", headers=headers) as r:
            shown = await r.json()
            assert r.status == 200 and shown["publishedVersion"] == 1 and shown["default"]
            assert json.loads(shown["agent"]["spec"]) == json.loads(spec)
        async with http.get(f"{base}/v2/agents", headers=headers) as r:
            assert [a["name"] for a in (await r.json())["agents"]] == ["writer"]

        bad = document("writer", "Write.", ["get_time"], limits={"max_steps": 0})
        async with http.post(f"{base}/v2/agents", json={"spec": bad}, headers=headers) as r:
            assert r.status == 400, await r.text()
            error = (await r.json())["error"]
            assert error["status"] == "INVALID_ARGUMENT" and "/limits/max_steps" in str(error)
        async with http.post(
            f"{base}/v2/agents/writer/rollback", json={"toVersion": 7}, headers=headers
        ) as r:
            assert r.status == 404, await r.text()
        async with http.get(f"{base}/v2/agents/writer/versions", headers=headers) as r:
            assert [v["version"] for v in (await r.json())["versions"]] == [1]


async def test_a_rollback_from_a_stale_base_is_aborted_and_changes_nothing(
    stack: ExecStack, tmp_path: Path
) -> None:
    tenant = await stack.tenant(scopes=AGENT_SCOPES)
    base, headers = http_base(stack), bearer(tenant.api_key)
    async with aiohttp.ClientSession() as http:
        for words in ("First.", "Second."):
            spec = document("notes", words, ["get_time"])
            async with http.post(f"{base}/v2/agents", json={"spec": spec}, headers=headers) as r:
                assert r.status == 201, await r.text()
        code, out = await tether(
            "agents",
            "rollback",
            "notes",
            "--to",
            "1",
            "--base-version",
            "1",
            "--stack",
            stack_file(stack, tenant.api_key, tmp_path),
        )
        assert code == 1 and "error: ABORTED: " in out and "at version 2, not 1" in out, out
        rollback = f"{base}/v2/agents/notes/rollback"
        stale = {"toVersion": 1, "baseVersion": 1}
        async with http.post(rollback, json=stale, headers=headers) as r:
            assert r.status == 409, await r.text()
            assert (await r.json())["error"]["status"] == "ABORTED"
        async with http.get(f"{base}/v2/agents/notes", headers=headers) as r:
            shown = await r.json()
            assert shown["publishedVersion"] == 2 and "Second." in shown["agent"]["spec"]
        async with http.get(f"{base}/v2/agents/notes/versions", headers=headers) as r:
            assert [v["version"] for v in (await r.json())["versions"]] == [1, 2]
        fresh = {"toVersion": 1, "baseVersion": 2}
        async with http.post(rollback, json=fresh, headers=headers) as r:
            assert r.status == 200 and await r.json() == {"name": "notes", "version": 1}


async def test_another_tenants_agent_is_not_found_and_writing_needs_agents_write(
    stack: ExecStack, tmp_path: Path
) -> None:
    owner = await stack.tenant(scopes=AGENT_SCOPES)
    other = await stack.tenant(scopes=AGENT_SCOPES)
    reader = await stack.tenant(
        tenant_id=owner.tenant_id, scopes=(*apikeys.CLIENT_SCOPES, apikeys.AGENTS_READ)
    )
    spec = document("private", "Mine alone.", ["get_time"])
    owner_file = stack_file(stack, owner.api_key, tmp_path)
    assert (await cli_json("agents", "apply", "-", "--stack", owner_file, stdin=spec))[0]["created"]

    base = http_base(stack)
    async with aiohttp.ClientSession() as http:
        bodies = []
        for name in ("private", "absent"):
            async with http.get(f"{base}/v2/agents/{name}", headers=bearer(other.api_key)) as r:
                assert r.status == 404
                bodies.append(await r.read())
        assert bodies[0] == bodies[1].replace(b"absent", b"private")
        async with http.post(
            f"{base}/v2/agents/private/rollback",
            json={"toVersion": 1},
            headers=bearer(other.api_key),
        ) as r:
            assert r.status == 404

        # A key that reads agents but may not write them: refused, nothing changes.
        changed = document("private", "Changed.", ["get_time"])
        async with http.post(
            f"{base}/v2/agents", json={"spec": changed}, headers=bearer(reader.api_key)
        ) as r:
            assert r.status == 403, await r.text()
            assert (await r.json())["error"]["status"] == "PERMISSION_DENIED"
        async with http.delete(f"{base}/v2/agents/private", headers=bearer(reader.api_key)) as r:
            assert r.status == 403
        async with http.get(f"{base}/v2/agents/private", headers=bearer(reader.api_key)) as r:
            shown = await r.json()
            assert shown["agent"]["version"] == 1 and "Mine alone." in shown["agent"]["spec"]

    async with grpc.aio.insecure_channel(stack.addr("gateway")) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.GetAgent(
                gateway_pb2.GetAgentRequest(name="private"), metadata=other.metadata
            )
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ApplyAgent(
                gateway_pb2.ApplyAgentRequest(spec=changed), metadata=reader.metadata
            )
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    reader_file = stack_file(stack, reader.api_key, tmp_path)
    code, out = await tether("agents", "rollback", "private", "--to", "1", "--stack", reader_file)
    assert code == 1 and "error: PERMISSION_DENIED: " in out, out
    versions = await cli_json("agents", "versions", "private", "--stack", owner_file)
    assert [v["version"] for v in versions] == [1]


async def test_the_workers_hello_fills_the_catalog_and_an_apply_must_name_its_tools_and_prices(
    stack: ExecStack, tmp_path: Path
) -> None:
    tenant = await stack.tenant(scopes=AGENT_SCOPES)
    file = stack_file(stack, tenant.api_key, tmp_path)
    (worker,) = (p for name, p in stack.services.procs.items() if name.startswith("worker"))
    worker_id = f"{socket.gethostname()}-{worker.process.pid}"

    listed = {t["name"]: t for t in await cli_json("tools", "list", "--stack", file)}
    assert set(listed) >= {"get_time", "publish_post", "ask_questions", "request_approval"}
    assert listed["publish_post"] == {
        "name": "publish_post",
        "risk": "publish",
        "writes_externally": True,
        "schema_sha256": schema_sha256(PublishPost.spec.input_schema),
        "announced_by": worker_id,
    }
    assert (listed["ask_questions"]["risk"], listed["get_time"]["risk"]) == ("interaction", "read")
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{http_base(stack)}/v2/tools", headers=bearer(tenant.api_key)) as r,
    ):
        assert r.status == 200, await r.text()
        assert [t["name"] for t in (await r.json())["tools"]] == sorted(listed)

    # Unknown tools: refused naming each and `tether tools list`, through the CLI and HTTP.
    unknown = tmp_path / "unknown.json"
    unknown.write_text(document("faxer", "Fax.", ["get_time", "send_fax", "shred"]))
    code, out = await tether("agents", "apply", str(unknown), "--stack", file)
    assert code == 1 and "INVALID_ARGUMENT" in out, out
    assert "/tools/1: tool 'send_fax' is not in the tool catalog" in out
    assert "/tools/2: tool 'shred'" in out and "tether tools list" in out
    unpriced = document("pricey", "Spend.", ["get_time"], model="mystery-9")
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{http_base(stack)}/v2/agents", json={"spec": unpriced}, headers=bearer(tenant.api_key)
        ) as r,
    ):
        assert r.status == 400, await r.text()
        error = (await r.json())["error"]
        assert error["status"] == "INVALID_ARGUMENT"
        assert "/model: model 'mystery-9' has no price" in error["message"]
    assert await cli_json("agents", "list", "--stack", file) == []

    # The built-in interaction tools are the worker's too, and a priced model is taken.
    fine = tmp_path / "fine.json"
    fine.write_text(
        document(
            "asker",
            "Ask first.",
            ["ask_questions", "request_approval", "get_time"],
            model="mystery-9",
            prices={"mystery-9": {"input": 1, "output": 2, "cache_write": 1, "cache_read": 0}},
        )
    )
    assert await cli_json("agents", "apply", str(fine), "--stack", file) == [
        {"name": "asker", "version": 1, "created": True}
    ]


async def test_the_operator_acts_on_a_named_tenants_agents_and_mints_its_first_agents_key(
    stack: ExecStack, tmp_path: Path
) -> None:
    # A tenant with no key that may write agents; the operator's stack file carries no key at all.
    tenant = await stack.tenant()
    other = await stack.tenant(scopes=AGENT_SCOPES)
    operator_file = stack_file(stack, "", tmp_path, operator_credential=OPERATOR)
    first = tmp_path / "first.json"
    first.write_text(document("concierge", "You greet.", ["get_time"]))
    within = ("--tenant", tenant.tenant_id, "--stack", operator_file)
    assert await cli_json("agents", "apply", str(first), *within) == [
        {"name": "concierge", "version": 1, "created": True}
    ]
    listed = await cli_json("agents", "list", *within)
    assert [(a["name"], a["published_version"]) for a in listed] == [("concierge", 1)]

    # Over gRPC: the tenant in the metadata, and only the tenant it names.
    as_operator = (("authorization", f"Bearer {OPERATOR}"), ("tether-tenant", tenant.tenant_id))
    async with grpc.aio.insecure_channel(stack.addr("gateway")) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        applied = await stub.ApplyAgent(
            gateway_pb2.ApplyAgentRequest(
                spec=document("concierge", "You greet warmly.", ["get_time"]), base_version=1
            ),
            metadata=as_operator,
        )
        assert (applied.version, applied.created) == (2, True)
        found = await stub.ListAgents(gateway_pb2.ListAgentsRequest(), metadata=as_operator)
        assert [(a.name, a.published_version) for a in found.agents] == [("concierge", 2)]
        with pytest.raises(grpc.aio.AioRpcError) as unnamed:
            await stub.ListAgents(gateway_pb2.ListAgentsRequest(), metadata=as_operator[:1])
        assert unnamed.value.code() == grpc.StatusCode.PERMISSION_DENIED

    # The operator mints the tenant's first agents:write key, which then applies in its tenant
    # and sees no other tenant's agents.
    (minted,) = await cli_json(
        "keys", "create", "--operator", "--tenant", tenant.tenant_id, "--principal", "p",
        "--scope", "agents:read", "--scope", "agents:write", "--stack", operator_file,
    )  # fmt: skip
    assert minted["tenant_id"] == tenant.tenant_id, minted
    key_file = stack_file(stack, minted["api_key"], tmp_path)
    second = tmp_path / "second.json"
    second.write_text(document("porter", "You carry.", ["get_time"], routes=[{"channel": "x"}]))
    assert await cli_json("agents", "apply", str(second), "--stack", key_file) == [
        {"name": "porter", "version": 1, "created": True}
    ]
    await cli_json("agents", "apply", "-", "--stack", stack_file(stack, other.api_key, tmp_path),
                   stdin=document("hidden", "Not yours.", ["get_time"]))  # fmt: skip
    names = [a["name"] for a in await cli_json("agents", "list", "--stack", key_file)]
    assert names == ["concierge", "porter"]
    code, out = await tether("agents", "show", "hidden", "--stack", key_file)
    assert code == 1 and "error: NOT_FOUND: " in out, out
