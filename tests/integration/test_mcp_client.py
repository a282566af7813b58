"""The worker's MCP client core (services.worker.mcp) against the local MCP stand-in over real
loopback HTTP, the SDK's client underneath: the offer (server__tool, risk, a warm cache costing
no round trip), calls with the idempotency key in `_meta` (one execution counted), a session
re-initialised after the server restarts, a cancel reaching the server, a 401 classified as a
connection gap with its OAuth metadata (and the flow completed with PKCE), and a server that is
down or answers garbage classified without anything raised."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import parse_qs, urlsplit

import httpx2
import pytest

from services.worker.mcp import McpClients, McpFailure, authorization_url, pkce_pair
from tether.domain import McpServer as McpServerEntry
from tether.targets import TargetPolicy
from tether.testing.mcp_auth import PUBLIC_CLIENT_ID, SCOPE
from tether.testing.mcp_server import McpServer

REDIRECT = "http://127.0.0.1/oauth/callback"
ALL_TOOLS = ("lookup_order", "cancel_order", "email_receipt", "slow_report")


def entry(server: McpServer, name: str = "orders", **more: object) -> McpServerEntry:
    """The agent's entry for `server`, every tool allowlisted unless said otherwise."""
    fields: dict[str, object] = {"tools": ALL_TOOLS, **more}
    return McpServerEntry(name, server.url, **fields)  # type: ignore[arg-type]


@pytest.fixture
async def clients() -> AsyncIterator[McpClients]:
    made = McpClients(connect_timeout_s=5)
    yield made
    await made.aclose()


async def test_the_offer_names_ranks_and_caches_the_allowlisted_tools(clients: McpClients) -> None:
    async with McpServer() as server:
        agent = entry(
            server,
            tools=("lookup_order", "cancel_order", "email_receipt", "gone"),
            risk={"email_receipt": "send_reply"},
        )
        offer, failures = await clients.offer([agent], taken=["get_time"])
        again, _ = await clients.offer([agent])
        listings = server.ledger.listings
    assert failures == {}
    assert [(t.name, t.tool, t.risk) for t in offer.tools] == [
        ("orders__cancel_order", "cancel_order", "delete"),
        ("orders__email_receipt", "email_receipt", "send_reply"),
        ("orders__lookup_order", "lookup_order", "read"),
    ]
    assert offer.warnings == (
        "MCP tool 'gone' of server 'orders' is allowlisted but the server does not list it",
    )
    assert [t.spec for t in again.tools] == [t.spec for t in offer.tools], "byte-stable"
    assert listings == 1, "the second lease was served from the cache"


async def test_a_call_sends_its_key_and_a_retry_with_it_runs_once(clients: McpClients) -> None:
    async with McpServer() as server:
        agent = entry(server)
        first = await clients.call(agent, "cancel_order", {"order_id": "A-1002"}, "run1:call1")
        retry = await clients.call(agent, "cancel_order", {"order_id": "A-1002"}, "run1:call1")
        read = await clients.call(agent, "lookup_order", {"order_id": "A-1002"}, "run1:call2")
    assert (first.is_error, first.failure, first.definite) == (False, None, True)
    assert first.content == retry.content == '{"order_id": "A-1002", "status": "cancelled"}'
    assert '"status": "cancelled"' in read.content
    assert server.ledger.executions_by_key == {"run1:call1": 1, "run1:call2": 1}
    assert server.ledger.replays == {"run1:call1": 1}
    assert server.ledger.initializations == 1, "one session for every call"


async def test_calls_on_one_session_share_one_connection(clients: McpClients) -> None:
    """The server ends each call's event stream right after its answer; the client reads that
    end before it lets the response go, so the connection is used again rather than a new one
    opened per call (measured before: one TCP connection per call)."""
    async with McpServer() as server:
        agent = entry(server)
        for i in range(10):
            outcome = await clients.call(agent, "lookup_order", {"order_id": "A-1001"}, f"k{i}")
            assert outcome.failure is None
        connections = len(server.ledger.post_connections)
    assert server.ledger.executions["lookup_order"] == 10
    assert connections <= 2, f"{connections} connections for 10 calls and the initialize"


async def test_a_tool_error_is_an_outcome_the_model_reads(clients: McpClients) -> None:
    async with McpServer() as server:
        agent = entry(server)
        missing = await clients.call(agent, "lookup_order", {"order_id": "Z-9"}, "k1")
        invalid = await clients.call(agent, "lookup_order", {}, "k2")
    assert (missing.failure, missing.definite) == (McpFailure.TOOL_ERROR, True)
    assert "no order Z-9" in missing.content
    assert invalid.failure is McpFailure.TOOL_ERROR
    assert "order_id" in invalid.content


async def test_the_session_is_initialised_again_after_the_server_restarts(
    clients: McpClients,
) -> None:
    async with McpServer() as server:
        agent = entry(server)
        await clients.call(agent, "lookup_order", {"order_id": "A-1001"}, "k1")
        await server.restart()
        after = await clients.call(agent, "cancel_order", {"order_id": "A-1001"}, "k2")
        await server.drop_sessions()  # a restart between two requests, without unbinding
        listed, _ = await clients.offer([entry(server, "orders-2")])
        assert server.ledger.initializations == 3
    assert (after.is_error, after.failure) == (False, None)
    assert server.ledger.executions_by_key == {"k1": 1, "k2": 1}
    assert len(listed.tools) == len(ALL_TOOLS)


async def test_a_server_restarted_mid_call_leaves_the_outcome_unknown_and_the_key_retries(
    clients: McpClients,
) -> None:
    async with McpServer() as server:
        agent = entry(server)
        call = asyncio.create_task(clients.call(agent, "slow_report", {"topic": "q"}, "slow-1"))
        await server.wait_until(lambda ledger: ledger.slow_started == 1)
        await server.restart()
        lost = await call
        server.release_slow()
        retried = await clients.call(agent, "slow_report", {"topic": "q"}, "slow-1")
    assert (lost.failure, lost.definite) == (McpFailure.CONNECTION_LOST, False)
    assert retried.content == "report on q"
    assert server.ledger.slow_interrupted == 1


async def test_a_cancel_reaches_the_server_as_notifications_cancelled(
    clients: McpClients,
) -> None:
    async with McpServer() as server:
        agent = entry(server)
        stop = asyncio.Event()
        call = asyncio.create_task(
            clients.call(agent, "slow_report", {"topic": "q"}, "slow-1", stop)
        )
        await server.wait_until(lambda ledger: ledger.slow_started == 1)
        stop.set()
        cancelled = await call
        await server.wait_until(lambda ledger: ledger.slow_interrupted == 1)

        # Cancelling the calling task does the same, and the cancellation propagates.
        task = asyncio.create_task(clients.call(agent, "slow_report", {"topic": "q"}, "slow-2"))
        await server.wait_until(lambda ledger: ledger.slow_started == 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await server.wait_until(lambda ledger: ledger.slow_interrupted == 2)
        notified = len(server.ledger.cancel_notifications)
    assert (cancelled.failure, cancelled.definite) == (McpFailure.CANCELLED, False)
    assert notified == 2


async def test_a_call_past_its_timeout_is_unknown_and_the_server_is_told(
    clients: McpClients,
) -> None:
    async with McpServer() as server:
        agent = entry(server)
        late = await clients.call(agent, "slow_report", {"topic": "q"}, "k", timeout_s=0.3)
        await server.wait_until(lambda ledger: ledger.slow_interrupted == 1)
    assert (late.failure, late.definite) == (McpFailure.TIMEOUT, False)
    assert server.ledger.cancel_notifications


async def test_a_401_is_a_connection_gap_carrying_the_oauth_metadata(
    clients: McpClients,
) -> None:
    async with McpServer(auth="oauth", redirect_uris=[REDIRECT]) as server:
        assert server.oauth is not None
        agent = entry(server, auth="oauth")
        gap = await clients.call(agent, "lookup_order", {"order_id": "A-1001"}, "k1")
        listing = await clients.list_tools(agent)
        assert gap.failure is McpFailure.UNAUTHORISED and gap.challenge is not None
        challenge = gap.challenge
        assert (challenge.status, challenge.gap, challenge.scopes) == (401, "absent", (SCOPE,))
        assert challenge.resource == server.url
        assert challenge.authorization_endpoint == server.base_url + "/authorize"
        assert challenge.token_endpoint == server.base_url + "/token"
        assert challenge.code_challenge_methods == ("S256",)
        assert listing.failure is not None
        assert listing.failure.failure is McpFailure.UNAUTHORISED

        verifier, _ = pkce_pair()
        url = authorization_url(
            challenge,
            client_id=PUBLIC_CLIENT_ID,
            redirect_uri=REDIRECT,
            state="tenant-bound-state",
            code_verifier=verifier,
        )
        async with httpx2.AsyncClient() as http:
            consent = await http.get(url)
            code = parse_qs(urlsplit(consent.headers["location"]).query)["code"][0]
            token = await http.post(
                challenge.token_endpoint,
                data={
                    "grant_type": "authorization_code",
                    "code": code,
                    "redirect_uri": REDIRECT,
                    "client_id": PUBLIC_CLIENT_ID,
                    "code_verifier": verifier,
                },
            )
        access = token.json()["access_token"]
        done = await clients.call(agent, "lookup_order", {"order_id": "A-1001"}, "k1", token=access)

        server.oauth.expire_access_tokens()
        expired = await clients.call(
            agent, "lookup_order", {"order_id": "A-1001"}, "k2", token=access
        )
        narrow = server.oauth.issue(["profile"])
        scant = await clients.call(
            agent, "lookup_order", {"order_id": "A-1001"}, "k3", token=narrow
        )
    assert (done.is_error, done.failure) == (False, None)
    assert expired.challenge is not None and expired.challenge.gap == "expired"
    assert scant.challenge is not None
    assert (scant.challenge.status, scant.challenge.gap) == (403, "insufficient_scope")


async def test_a_bearer_secret_opens_the_server_and_a_wrong_one_is_a_gap(
    clients: McpClients,
) -> None:
    async with McpServer(auth={"bearer": "s3cret"}) as server:
        agent = entry(server, auth="bearer", bearer_secret="ORDERS_TOKEN")
        good = await clients.call(
            agent, "lookup_order", {"order_id": "A-1001"}, "k1", token="s3cret"
        )
        bad = await clients.call(agent, "lookup_order", {"order_id": "A-1001"}, "k2", token="nope")
    assert good.failure is None
    assert bad.failure is McpFailure.UNAUTHORISED
    assert bad.challenge is not None and bad.challenge.gap == "expired"
    assert "nope" not in repr(clients._connections), "a token is not kept as a key"


async def test_garbage_unavailable_and_down_are_classified_and_never_raised(
    clients: McpClients,
) -> None:
    async with McpServer() as server:
        agent = entry(server)
        await clients.call(agent, "lookup_order", {"order_id": "A-1001"}, "k0")
        server.mode = "garbage"
        garbage = await clients.call(agent, "lookup_order", {"order_id": "A-1001"}, "k1")
        server.mode = "unavailable"
        unavailable = await clients.call(agent, "lookup_order", {"order_id": "A-1001"}, "k2")
        server.mode = "ok"
        await server.stop()
        down = await clients.call(agent, "lookup_order", {"order_id": "A-1001"}, "k3")
        offer, failures = await clients.offer([entry(server, "other")])
        await server.start()
        back = await clients.call(agent, "lookup_order", {"order_id": "A-1001"}, "k4")
    assert (garbage.failure, garbage.definite) == (McpFailure.PROTOCOL, False)
    assert (unavailable.failure, unavailable.definite) == (McpFailure.SERVER_DOWN, False)
    assert "503" in unavailable.content
    assert (down.failure, down.definite) == (McpFailure.SERVER_DOWN, True)
    assert offer.tools == ()
    assert offer.warnings[0].startswith("MCP server 'other' is left out: the MCP server cannot")
    assert failures["other"].failure is McpFailure.SERVER_DOWN
    assert back.failure is None
    assert server.ledger.executions_by_key == {"k0": 1, "k4": 1}


async def test_a_url_the_target_policy_forbids_is_refused_before_any_connection() -> None:
    async with McpServer() as server:
        public_only = McpClients(target_policy=TargetPolicy.parse(""))
        refused = await public_only.call(entry(server), "lookup_order", {"order_id": "A-1"}, "k")
        loopback = McpClients(target_policy=TargetPolicy.parse("loopback"))
        allowed = await loopback.call(entry(server), "lookup_order", {"order_id": "A-1001"}, "k")
        await loopback.aclose()
        await public_only.aclose()
    assert (refused.failure, refused.definite) == (McpFailure.REFUSED_TARGET, True)
    assert "loopback" in refused.content
    assert allowed.failure is None
    assert server.ledger.initializations == 1


async def test_past_max_sessions_the_least_recently_used_idle_one_is_closed() -> None:
    clients = McpClients(max_sessions=1)
    try:
        async with McpServer() as server:
            first, second = entry(server, "first"), entry(server, "second")
            outcomes = [
                await clients.call(e, "lookup_order", {"order_id": "A-1001"}, f"k{i}")
                for i, e in enumerate((first, second, first))
            ]
            initializations = server.ledger.initializations
    finally:
        await clients.aclose()
    assert [o.failure for o in outcomes] == [None, None, None]
    assert initializations == 3, "the first session was closed for the second, then reopened"
