"""The local MCP stand-in spoken to by the official SDK's own client (ClientSession over the
streamable-HTTP transport, on loopback): its tools and annotations, the idempotency key in
`_meta` honoured (one execution per key, counted), a cancel seen as `notifications/cancelled`,
a restart on the same port losing every session, the bearer and OAuth (PKCE) modes, garbage and
unavailable answers, and the command line with its control endpoints."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import os
import re
import secrets
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast
from urllib.parse import parse_qs, urlsplit

import httpx2
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import PARSE_ERROR, RequestParamsMeta

import tether.testing.mcp_server as mcp_module
from tether.mcp_wire import IDEMPOTENCY_KEY_META
from tether.testing.mcp_auth import PUBLIC_CLIENT_ID
from tether.testing.mcp_server import McpServer

LIBS_DIR = Path(mcp_module.__file__).resolve().parents[2]
REDIRECT = "http://127.0.0.1/oauth/callback"


@contextlib.asynccontextmanager
async def session(url: str, token: str | None = None) -> AsyncIterator[ClientSession]:
    """An initialised SDK session with `url` (as `token`'s bearer when given)."""
    headers = {"authorization": f"Bearer {token}"} if token else None
    async with (
        httpx2.AsyncClient(headers=headers) as http,
        streamable_http_client(url, http_client=http) as (read, write),
        ClientSession(read, write) as client,
    ):
        await client.initialize()
        yield client


def _meta(key: str) -> RequestParamsMeta:
    """`_meta` carrying an idempotency key (an open map; the TypedDict names only the
    protocol's own keys)."""
    return cast("RequestParamsMeta", {IDEMPOTENCY_KEY_META: key})


def _text(result: object) -> str:
    content = getattr(result, "content", [])
    return "".join(getattr(block, "text", "") for block in content)


async def test_the_tools_are_listed_with_their_annotations() -> None:
    async with McpServer() as server, session(server.url) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
    assert sorted(tools) == ["cancel_order", "email_receipt", "lookup_order", "slow_report"]
    hints = {
        name: (a.read_only_hint, a.destructive_hint, a.open_world_hint)
        for name, t in tools.items()
        if (a := t.annotations) is not None
    }
    assert hints == {
        "lookup_order": (True, None, False),
        "cancel_order": (False, True, False),
        "email_receipt": (False, False, True),
    }
    assert tools["lookup_order"].input_schema["required"] == ["order_id"]
    assert server.ledger.listings == 1


async def test_a_second_call_with_the_same_key_replays_without_running_again() -> None:
    async with McpServer() as server, session(server.url) as client:
        meta = _meta("key-1")
        first = await client.call_tool("cancel_order", {"order_id": "A-1002"}, meta=meta)
        server.ledger.orders["A-1002"]["status"] = "processing"  # a second run would change it
        again = await client.call_tool("cancel_order", {"order_id": "A-1002"}, meta=meta)
        other = await client.call_tool(
            "cancel_order",
            {"order_id": "A-1002"},
            meta=_meta("key-2"),
        )
        unkeyed = [await client.call_tool("lookup_order", {"order_id": "A-1001"}) for _ in "ab"]
    assert _text(first) == _text(again) == '{"order_id": "A-1002", "status": "cancelled"}'
    assert not first.is_error and not other.is_error
    assert server.ledger.executions == {"cancel_order": 2, "lookup_order": 2}
    assert server.ledger.executions_by_key == {"key-1": 1, "key-2": 1}
    assert server.ledger.replays == {"key-1": 1}
    assert all(not r.is_error for r in unkeyed)


async def test_a_tool_error_is_stored_under_its_key_and_replayed_as_one() -> None:
    async with McpServer() as server, session(server.url) as client:
        meta = _meta("key-9")
        first = await client.call_tool("lookup_order", {"order_id": "Z-1"}, meta=meta)
        server.ledger.orders["Z-1"] = {"status": "shipped", "total": "1.00"}
        again = await client.call_tool("lookup_order", {"order_id": "Z-1"}, meta=meta)
    assert first.is_error and again.is_error
    assert "no order Z-1" in _text(again)
    assert server.ledger.executions_by_key == {"key-9": 1}


async def test_a_cancelled_call_reaches_the_server_as_notifications_cancelled() -> None:
    async with McpServer() as server, session(server.url) as client:
        call = asyncio.create_task(client.call_tool("slow_report", {"topic": "q3"}))
        await server.wait_until(lambda ledger: ledger.slow_started == 1)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await server.wait_until(lambda ledger: ledger.slow_interrupted == 1)
        assert len(server.ledger.cancel_notifications) == 1
        # The session goes on: a released slow call answers.
        server.release_slow()
        done = await client.call_tool("slow_report", {"topic": "q4"})
    assert _text(done) == "report on q4"
    assert server.ledger.executions["slow_report"] == 2


async def test_a_restart_keeps_the_port_and_the_ledger_and_loses_every_session() -> None:
    async with McpServer() as server:
        port = server.port
        async with session(server.url) as client:
            meta = _meta("key-r")
            await client.call_tool("cancel_order", {"order_id": "A-1001"}, meta=meta)
            await server.restart()
            with pytest.raises(MCPError, match="Session not found"):
                await client.call_tool("lookup_order", {"order_id": "A-1001"})
        assert server.port == port
        async with session(server.url) as client:
            replayed = await client.call_tool("cancel_order", {"order_id": "A-1001"}, meta=meta)
    assert not replayed.is_error
    assert server.ledger.executions_by_key == {"key-r": 1}
    assert server.ledger.initializations == 2


async def test_garbage_and_unavailable_are_what_the_sdk_sees() -> None:
    async with McpServer() as server:
        server.mode = "garbage"
        with pytest.raises(BaseExceptionGroup) as garbage:
            async with session(server.url):
                pass
        server.mode = "unavailable"
        async with httpx2.AsyncClient() as http:
            unavailable = await http.post(server.url, json={})
        server.mode = "ok"
        async with session(server.url) as client:
            assert not (await client.call_tool("lookup_order", {"order_id": "A-1001"})).is_error
    parse_errors = garbage.value.subgroup(lambda e: isinstance(e, MCPError))
    assert parse_errors is not None
    assert _leaves(parse_errors)[0].code == PARSE_ERROR  # type: ignore[attr-defined]
    assert unavailable.status_code == 503


def _leaves(group: BaseException) -> list[BaseException]:
    if isinstance(group, BaseExceptionGroup):
        return [leaf for e in group.exceptions for leaf in _leaves(e)]
    return [group]


async def test_bearer_mode_refuses_without_the_secret_and_says_where_its_metadata_is() -> None:
    async with McpServer(auth={"bearer": "s3cret"}) as server:
        async with httpx2.AsyncClient() as http:
            for token in (None, "wrong"):
                headers = {"authorization": f"Bearer {token}"} if token else {}
                refused = await http.post(server.url, json={}, headers=headers)
                assert refused.status_code == 401
                challenge = refused.headers["www-authenticate"]
                assert "resource_metadata" in challenge, challenge
        async with session(server.url, "s3cret") as client:
            result = await client.call_tool("lookup_order", {"order_id": "A-1001"})
    assert not result.is_error


async def test_the_oauth_flow_from_401_to_a_call_with_pkce() -> None:
    async with McpServer(auth="oauth", redirect_uris=[REDIRECT]) as server:
        assert server.oauth is not None
        async with httpx2.AsyncClient() as http:
            refused = await http.post(server.url, json={})
            assert refused.status_code == 401
            metadata_url = re.search(
                r'resource_metadata="([^"]+)"', refused.headers["www-authenticate"]
            )
            assert metadata_url is not None
            resource = (await http.get(metadata_url.group(1))).json()
            issuer = resource["authorization_servers"][0].rstrip("/")
            authz = (await http.get(f"{issuer}/.well-known/oauth-authorization-server")).json()
            assert authz["code_challenge_methods_supported"] == ["S256"]

            verifier = secrets.token_urlsafe(48)
            challenge = (
                base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest())
                .decode()
                .rstrip("=")
            )
            consent = await http.get(
                authz["authorization_endpoint"],
                params={
                    "response_type": "code",
                    "client_id": PUBLIC_CLIENT_ID,
                    "redirect_uri": REDIRECT,
                    "state": "st-1",
                    "code_challenge": challenge,
                    "code_challenge_method": "S256",
                    "scope": "orders",
                    "resource": resource["resource"],
                },
            )
            assert consent.status_code == 302, consent.text
            back = parse_qs(urlsplit(consent.headers["location"]).query)
            assert back["state"] == ["st-1"]
            form = {
                "grant_type": "authorization_code",
                "code": back["code"][0],
                "redirect_uri": REDIRECT,
                "client_id": PUBLIC_CLIENT_ID,
            }
            wrong = await http.post(
                authz["token_endpoint"], data={**form, "code_verifier": "x" * 43}
            )
            assert wrong.status_code == 400
            token = await http.post(
                authz["token_endpoint"], data={**form, "code_verifier": verifier}
            )
            assert token.status_code == 200, token.text
            access = token.json()["access_token"]
        async with session(server.url, access) as client:
            result = await client.call_tool("lookup_order", {"order_id": "A-1001"})
    assert not result.is_error


async def test_the_cli_serves_in_a_separate_process_scripted_through_its_control_routes() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(LIBS_DIR), env.get("PYTHONPATH")]))
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tether.testing.mcp_server",
        "--port",
        "0",
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        assert process.stdout is not None
        async with asyncio.timeout(30):
            line = (await process.stdout.readline()).decode()
        announced = re.fullmatch(r"mcp listening (http://127\.0\.0\.1:\d+)/mcp\n", line)
        assert announced, line
        base = announced.group(1)
        async with session(base + "/mcp") as client:
            meta = _meta("cli-1")
            for _ in "ab":
                await client.call_tool("cancel_order", {"order_id": "A-1001"}, meta=meta)
            async with httpx2.AsyncClient(base_url=base) as control:
                assert (await control.post("/_mode", json={"mode": "nope"})).status_code == 400
                assert (await control.post("/_restart")).status_code == 200
                with pytest.raises(MCPError, match="Session not found"):
                    await client.call_tool("lookup_order", {"order_id": "A-1001"})
                state = (await control.get("/_state")).json()
        assert state["executions_by_key"] == {"cli-1": 1}
        assert state["replays"] == {"cli-1": 1}
        assert state["orders"]["A-1001"]["status"] == "cancelled"
    finally:
        if process.returncode is None:
            process.terminate()
            await process.wait()
