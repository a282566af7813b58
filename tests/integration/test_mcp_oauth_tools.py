"""An `auth: oauth` MCP server at lease and call time (services.worker.mcp.tools), against the
local stand-in in OAuth mode over loopback: with the principal's token the server's real tools
are offered and called; without a usable one its allowlisted tools are offered connect-first and
a call pauses for the connection with the server's discovered endpoints, the gap told apart
(absent, expired, insufficient scope), never leaving the server's tools unoffered silently."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence

import pytest

from services.worker.mcp import McpClients
from services.worker.mcp.gap import McpConnectionGap
from services.worker.mcp.tools import LeasedTools, McpToolbox, TokenSource
from tether.domain import AgentConfig
from tether.domain import McpServer as Entry
from tether.testing.mcp_auth import SCOPE
from tether.testing.mcp_server import McpServer
from tether.testing.tools import ToolKit
from tether.tools.base import ConnectionGap


def agent(server: McpServer) -> AgentConfig:
    entry = Entry("shop", server.url, auth="oauth", tools=("lookup_order",), risk={})
    return AgentConfig(model="m", agent="shop", mcp_servers=(entry,))


def store(
    token: str | None = None, gap: str = "absent", refreshed: Callable[[], str] | None = None
) -> tuple[TokenSource, list[str]]:
    """The principal's connections as interactions answers them (a token reported refused is
    `refreshed`, or `expired` when there is none to refresh it with); which providers were
    asked, a refresh as `<provider> refresh`."""
    asked: list[str] = []

    async def resolve(provider: str, scopes: Sequence[str], refused: str = "") -> str:
        asked.append(f"{provider} refresh" if refused else provider)
        if token is None or (refused and refreshed is None):
            raise ConnectionGap(
                provider=provider,
                gap=gap if token is None else "expired",
                scopes=scopes,
                credential_ref=f"connection:{provider}",
            )
        assert not refused or refused == token, "the refused token is the one the store gave"
        return refreshed() if refused and refreshed is not None else token

    return resolve, asked


@pytest.fixture
async def box() -> AsyncIterator[McpToolbox]:
    made = McpToolbox(McpClients(connect_timeout_s=5), call_timeout_s=5)
    yield made
    await made.clients.aclose()


@pytest.fixture
async def guarded() -> AsyncIterator[McpServer]:
    async with McpServer(auth="oauth") as server:
        yield server


async def paused_gap(leased: LeasedTools) -> McpConnectionGap:
    kit = ToolKit(leased.tools["shop__lookup_order"].tool)  # type: ignore[arg-type]
    outcome = await kit.call({"order_id": "A-1001"})
    assert outcome.paused and outcome.fired == 1, outcome
    (gap,) = kit.desk.offers
    assert isinstance(gap, McpConnectionGap)
    return gap


async def test_with_the_principals_token_the_real_tool_is_offered_and_called(
    box: McpToolbox, guarded: McpServer
) -> None:
    assert guarded.oauth is not None
    resolve, asked = store(guarded.oauth.issue([SCOPE]))
    leased = await box.lease(agent(guarded), None, (), resolve)
    assert asked == ["mcp:shop"]
    assert leased.warnings == ()
    kit = ToolKit(leased.tools["shop__lookup_order"].tool)  # type: ignore[arg-type]
    outcome = await kit.call({"order_id": "A-1001"})
    assert not outcome.is_error and "shipped" in (outcome.content or ""), outcome
    assert guarded.ledger.executions == {"lookup_order": 1}


async def test_without_a_connection_a_call_pauses_with_the_discovered_endpoints(
    box: McpToolbox, guarded: McpServer
) -> None:
    resolve, _ = store(None)
    leased = await box.lease(agent(guarded), None, (), resolve)
    assert leased.warnings == (), "offered connect-first, not left out"
    assert [s["name"] for s in leased.specs] == ["shop__lookup_order"]
    gap = await paused_gap(leased)
    assert (gap.provider, gap.gap) == ("mcp:shop", "absent")
    assert gap.challenge.authorization_endpoint == f"{guarded.base_url}/authorize"
    assert gap.challenge.token_endpoint == f"{guarded.base_url}/token"
    assert guarded.ledger.executions == {}


async def test_the_gap_says_expired_or_insufficient_scope_as_the_store_or_server_does(
    box: McpToolbox, guarded: McpServer
) -> None:
    assert guarded.oauth is not None
    resolve, _ = store(None, gap="expired")  # past its expiry and not refreshable
    assert (await paused_gap(await box.lease(agent(guarded), None, (), resolve))).gap == "expired"
    stale = guarded.oauth.issue([SCOPE])
    guarded.oauth.expire_access_tokens()  # the store thinks it good; the server refuses it
    resolve, _ = store(stale)
    assert (await paused_gap(await box.lease(agent(guarded), None, (), resolve))).gap == "expired"
    resolve, _ = store(guarded.oauth.issue(["other"]))
    leased = await box.lease(agent(guarded), None, (), resolve)
    assert (await paused_gap(leased)).gap == "insufficient_scope"
    assert guarded.ledger.executions == {}


async def test_a_token_refused_mid_run_pauses_the_call_instead_of_failing_it(
    box: McpToolbox, guarded: McpServer
) -> None:
    assert guarded.oauth is not None
    resolve, _ = store(guarded.oauth.issue([SCOPE]))
    leased = await box.lease(agent(guarded), None, (), resolve)
    guarded.oauth.expire_access_tokens()
    gap = await paused_gap(leased)
    assert (gap.provider, gap.gap) == ("mcp:shop", "expired")
    assert guarded.ledger.executions == {}


async def test_a_token_refused_before_its_expiry_is_refreshed_at_lease_and_the_tool_offered(
    box: McpToolbox, guarded: McpServer
) -> None:
    assert guarded.oauth is not None
    stale = guarded.oauth.issue([SCOPE])
    guarded.oauth.expire_access_tokens()  # revoked at the server; the store thinks it good
    new = guarded.oauth.issue([SCOPE])
    resolve, asked = store(stale, refreshed=lambda: new)
    leased = await box.lease(agent(guarded), None, (), resolve)
    kit = ToolKit(leased.tools["shop__lookup_order"].tool)  # type: ignore[arg-type]
    outcome = await kit.call({"order_id": "A-1001"})
    assert not outcome.paused and not outcome.is_error, outcome
    assert asked == ["mcp:shop", "mcp:shop refresh"]
    assert guarded.ledger.executions == {"lookup_order": 1}


async def test_a_token_refused_mid_run_is_refreshed_once_and_the_call_runs_once(
    box: McpToolbox, guarded: McpServer
) -> None:
    oauth = guarded.oauth
    assert oauth is not None
    resolve, asked = store(oauth.issue([SCOPE]), refreshed=lambda: oauth.issue([SCOPE]))
    leased = await box.lease(agent(guarded), None, (), resolve)
    oauth.expire_access_tokens()  # revoked after the lease listed the tools with it
    kit = ToolKit(leased.tools["shop__lookup_order"].tool)  # type: ignore[arg-type]
    outcome = await kit.call({"order_id": "A-1001"})
    assert not outcome.paused and not outcome.is_error, outcome
    assert asked == ["mcp:shop", "mcp:shop refresh"]
    assert guarded.ledger.executions == {"lookup_order": 1}
