"""An `auth: oauth` MCP server connected per principal through the connection pause, end to end:
real services, the worker as a process, and the local MCP server in OAuth mode (its own small
PKCE authorisation server).

The model calls the protected tool; the server refuses the worker (no token), so the run parks
`waiting-for-connection` with a consent URL built from the server's discovered metadata; the test
follows it as a browser would (the authorisation endpoint redirects to the callback with a code
and the state), the consent is completed at the gateway, interactions exchanges the code (with
the PKCE verifier it kept) at the discovered token endpoint, and the resumed run calls the tool
with the token. An expired access token is refreshed at the token endpoint instead of pausing;
one whose refresh token was revoked pauses again, saying "expired".
No token ever appears in a service's log."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx2
import pytest
import pytest_asyncio
from sqlalchemy import update

from tests.system.execution_support import ExecStack, Tenant, exec_stack, wait_for_status
from tests.system.streaming_support import prompt
from tests.system.test_interactions import client, connection_rows
from tests.system.test_mcp_tools import SCOPES, shop, tool_results
from tests.system.test_tool_package import apply
from tether.db.engine import create_engine
from tether.db.schema import connections
from tether.testing.mcp_auth import PUBLIC_CLIENT_ID
from tether.testing.mcp_server import McpServer
from tether.testing.model_server import TextTurn, ToolUseTurn
from tether.v1 import interactions_pb2

pytestmark = pytest.mark.slow

CALLBACK = (
    "http://127.0.0.1/v1/oauth/callback"  # the stack's TETHER_INTERACTIONS_OAUTH_REDIRECT_URI
)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def guarded() -> AsyncIterator[McpServer]:
    server = McpServer(auth="oauth", redirect_uris=[CALLBACK])
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ExecStack]:
    run_dir = Path(tmp_path_factory.mktemp("mcp-oauth"))
    env = {
        "TETHER_ALLOW_PRIVATE_TARGETS": "loopback",
        "TETHER_INTERACTIONS_MCP_OAUTH_CLIENT_ID": PUBLIC_CLIENT_ID,
    }
    async with exec_stack(
        pg_server_url, template_db, redis_url, run_dir, workers=1, extra_env=env
    ) as running:
        yield running


async def oauth_tenant(stack: ExecStack, url: str) -> Tenant:
    tenant = await stack.tenant(scopes=SCOPES)
    await apply(tenant, shop(url, auth="oauth", tools=["lookup_order"], risk={}))
    return tenant


async def connect(
    stack: ExecStack,
    tenant: Tenant,
    run_id: str,
    guarded: McpServer,
    gap: int = interactions_pb2.CONNECTION_GAP_ABSENT,
) -> None:
    """The person follows the consent URL and the callback's code completes the consent."""
    async with client(stack, tenant) as tc:
        offer = (await tc.pending_connection(run_id)).connection
    assert offer.provider == "mcp:shop"
    assert offer.gap == gap
    url = urlsplit(offer.login_url)
    query = parse_qs(url.query)
    assert f"{url.scheme}://{url.netloc}{url.path}" == f"{guarded.base_url}/authorize"
    assert query["code_challenge_method"] == ["S256"] and query["code_challenge"]
    assert query["client_id"] == [PUBLIC_CLIENT_ID] and query["redirect_uri"] == [CALLBACK]
    assert "code_verifier" not in query, "the verifier stays with interactions"
    async with httpx2.AsyncClient() as browser:
        answered = await browser.get(offer.login_url, follow_redirects=False)
    assert answered.status_code in (302, 303, 307), answered.text
    back = urlsplit(answered.headers["location"])
    assert f"{back.scheme}://{back.netloc}{back.path}" == CALLBACK
    returned = parse_qs(back.query)
    assert returned["state"] == query["state"]
    async with client(stack, tenant) as tc:
        completed = await tc.complete_connection(run_id, returned["state"][0], returned["code"][0])
    assert completed.resumed


def assert_never_logged(stack: ExecStack, guarded: McpServer) -> None:
    assert guarded.oauth is not None
    issued = [*guarded.oauth.access, *guarded.oauth.refresh]
    assert issued
    logs = list(stack.services.run_dir.glob("*.log"))
    assert logs
    for log in logs:
        text = log.read_text(errors="replace")
        for token in issued:
            assert token not in text, f"{log.name} logged a token"
    assert all(t not in json.dumps(r.body) for r in stack.model.requests for t in issued)


async def test_an_oauth_server_pauses_for_consent_resumes_with_the_token_and_refreshes_it(
    stack: ExecStack, guarded: McpServer
) -> None:
    tenant = await oauth_tenant(stack, guarded.url)
    text = prompt("mcp oauth")
    stack.model.script(
        text, [ToolUseTurn("shop__lookup_order", {"order_id": "A-1002"}), TextTurn("Packing.")]
    )
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "waiting-for-connection")
    assert guarded.ledger.executions == {}, "nothing ran without the connection"
    await connect(stack, tenant, run_id, guarded)
    run = await wait_for_status(stack.db_url, run_id, "completed")
    assert run.result_text == "Packing."
    results = await tool_results(stack, run_id)
    assert json.loads(results[-1]["content"])["status"] == "processing", results
    assert guarded.ledger.executions == {"lookup_order": 1}
    assert await connection_rows(stack, tenant.tenant_id) == ["sealed"]
    assert_never_logged(stack, guarded)

    # The access token expires: the next run's lease has it refreshed at the token endpoint
    # with the sealed refresh token, and calls the tool without pausing.
    await expire(stack, tenant, guarded)
    again = prompt("mcp oauth refreshed")
    stack.model.script(
        again, [ToolUseTurn("shop__lookup_order", {"order_id": "A-1001"}), TextTurn("Shipped.")]
    )
    second = await tenant.send(again)
    run = await wait_for_status(stack.db_url, second, "completed")
    assert run.result_text == "Shipped."
    assert guarded.ledger.executions == {"lookup_order": 2}
    assert_never_logged(stack, guarded)

    # Revoked at the server while the store holds it unexpired: the lease's listing is refused,
    # the store refreshes the token it still holds, and the run goes on without pausing.
    assert guarded.oauth is not None
    guarded.oauth.expire_access_tokens()
    revoked = prompt("mcp oauth revoked early")
    stack.model.script(
        revoked, [ToolUseTurn("shop__lookup_order", {"order_id": "A-1001"}), TextTurn("Still.")]
    )
    run = await wait_for_status(stack.db_url, await tenant.send(revoked), "completed")
    assert run.result_text == "Still."
    assert guarded.ledger.executions == {"lookup_order": 3}

    # Expired again, and the refresh token revoked: the run pauses, and says "expired".
    await expire(stack, tenant, guarded)
    assert guarded.oauth is not None
    guarded.oauth.refresh.clear()
    third = prompt("mcp oauth revoked")
    stack.model.script(
        third, [ToolUseTurn("shop__lookup_order", {"order_id": "A-1001"}), TextTurn("Again.")]
    )
    run_id = await tenant.send(third)
    await wait_for_status(stack.db_url, run_id, "waiting-for-connection")
    await connect(stack, tenant, run_id, guarded, interactions_pb2.CONNECTION_GAP_EXPIRED)
    run = await wait_for_status(stack.db_url, run_id, "completed")
    assert run.result_text == "Again."
    assert guarded.ledger.executions == {"lookup_order": 4}
    assert_never_logged(stack, guarded)


async def expire(stack: ExecStack, tenant: Tenant, guarded: McpServer) -> None:
    """The tenant's connection past its expiry, and every access token issued refused."""
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                update(connections)
                .where(connections.c.tenant_id == tenant.tenant_id)
                .values(expires_at=connections.c.created_at)
            )
    finally:
        await engine.dispose()
    assert guarded.oauth is not None
    guarded.oauth.expire_access_tokens()
