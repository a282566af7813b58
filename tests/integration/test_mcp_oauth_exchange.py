"""Interactions' OAuth client for MCP servers (services.interactions.mcp_oauth) against the local
stand-in's authorisation server over loopback: the consent URL (PKCE S256, the state, the
resource) followed as a browser would, the code exchanged with its verifier, the refresh token
used; a wrong verifier or code refused in words a person can act on; a token endpoint the
deployment's private-address rule forbids never called."""

from __future__ import annotations

from collections.abc import AsyncIterator
from urllib.parse import parse_qs, urlsplit

import httpx2
import pytest

from services.interactions.mcp_oauth import McpEndpoints, McpOAuth, pkce_pair
from tether.errors import FailedPrecondition, InvalidArgument
from tether.targets import TargetPolicy
from tether.testing.mcp_auth import PUBLIC_CLIENT_ID, SCOPE
from tether.testing.mcp_server import DEFAULT_REDIRECT_URIS, McpServer

REDIRECT = DEFAULT_REDIRECT_URIS[0]


@pytest.fixture
async def guarded() -> AsyncIterator[McpServer]:
    async with McpServer(auth="oauth") as server:
        yield server


def endpoints(server: McpServer) -> McpEndpoints:
    return McpEndpoints(f"{server.base_url}/authorize", f"{server.base_url}/token", server.url)


async def consent(client: McpOAuth, server: McpServer) -> tuple[str, str]:
    """(code, verifier) after a person consents at the URL."""
    verifier, challenge = pkce_pair()
    url = await client.consent_url(endpoints(server), "st-1", challenge, [SCOPE])
    query = parse_qs(urlsplit(url).query)
    assert query["code_challenge_method"] == ["S256"] and query["state"] == ["st-1"]
    assert query["resource"] == [server.url] and query["scope"] == [SCOPE]
    async with httpx2.AsyncClient() as browser:
        answered = await browser.get(url, follow_redirects=False)
    back = parse_qs(urlsplit(answered.headers["location"]).query)
    assert back["state"] == ["st-1"]
    return back["code"][0], verifier


async def test_the_code_is_exchanged_with_its_verifier_and_the_refresh_token_works(
    guarded: McpServer,
) -> None:
    assert guarded.oauth is not None
    client = McpOAuth(PUBLIC_CLIENT_ID, REDIRECT, TargetPolicy.parse("loopback"))
    code, verifier = await consent(client, guarded)
    token_url = f"{guarded.base_url}/token"
    got = await client.exchange(token_url, PUBLIC_CLIENT_ID, code, verifier)
    assert got.access_token in guarded.oauth.access and got.refresh_token in guarded.oauth.refresh
    assert got.scopes == (SCOPE,) and got.lifetime_s > 0
    renewed = await client.refresh(token_url, PUBLIC_CLIENT_ID, got.refresh_token)
    assert renewed.access_token != got.access_token
    assert renewed.access_token in guarded.oauth.access


async def test_a_wrong_verifier_or_a_spent_code_is_refused_without_echoing_it(
    guarded: McpServer,
) -> None:
    client = McpOAuth(PUBLIC_CLIENT_ID, REDIRECT, TargetPolicy.parse("loopback"))
    code, _ = await consent(client, guarded)
    token_url = f"{guarded.base_url}/token"
    with pytest.raises(FailedPrecondition) as wrong:
        await client.exchange(token_url, PUBLIC_CLIENT_ID, code, pkce_pair()[0])
    assert wrong.value.code == "oauth_code_refused" and code not in wrong.value.message
    assert "start the consent again" in wrong.value.message
    with pytest.raises(FailedPrecondition):
        await client.refresh(token_url, PUBLIC_CLIENT_ID, "not-a-refresh-token")


async def test_a_forbidden_token_endpoint_is_never_called(guarded: McpServer) -> None:
    assert guarded.oauth is not None
    public_only = McpOAuth(PUBLIC_CLIENT_ID, REDIRECT, TargetPolicy.parse(""))
    with pytest.raises(InvalidArgument):
        await public_only.consent_url(endpoints(guarded), "st", "ch", [SCOPE])
    with pytest.raises(FailedPrecondition) as refused:
        await public_only.exchange(f"{guarded.base_url}/token", PUBLIC_CLIENT_ID, "c", "v")
    assert refused.value.code == "mcp_refused_target"
    assert not guarded.oauth.access, "nothing was issued"


async def test_metadata_without_endpoints_cannot_be_connected() -> None:
    client = McpOAuth(PUBLIC_CLIENT_ID, REDIRECT, TargetPolicy.parse("loopback"))
    with pytest.raises(InvalidArgument, match="no authorisation or token endpoint"):
        await client.consent_url(McpEndpoints("", "http://127.0.0.1:1/token"), "s", "c", [])
    with pytest.raises(InvalidArgument, match="not an http"):
        await client.consent_url(McpEndpoints("javascript:x", "http://h/token"), "s", "c", [])
