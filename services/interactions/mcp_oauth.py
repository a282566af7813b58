"""OAuth for `auth: oauth` MCP servers, per principal, under provider `mcp:<server>`.

Unlike a configured provider, an MCP server names its own authorisation server: the worker
discovers its metadata (RFC 9728, RFC 8414) when the server refuses it and sends the endpoints
with the gap. Interactions then builds the consent URL (authorisation code, PKCE S256, the state
bound to tenant and principal as for any consent, RFC 8707 `resource`), keeps the code verifier
sealed with the pending offer (nobody is ever given it), and at the callback exchanges the code at
the discovered token endpoint; a connection keeps that endpoint and its refresh token (sealed),
so an expired access token is refreshed there before a run is paused for it.

Every call to a token endpoint goes through `tether.targets`' session: a server's metadata is a
URL an agent's author chose, so the deployment's private-address rule applies to it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlencode

import aiohttp

from tether.errors import FailedPrecondition, InvalidArgument, Unavailable
from tether.targets import TargetPolicy, check_url, refused_target, target_session

MCP_PREFIX = "mcp:"
_TIMEOUT = aiohttp.ClientTimeout(total=10.0)
_MAX_BODY = 64 * 1024


@dataclass(frozen=True)
class McpEndpoints:
    """What the MCP server's metadata named (the worker discovered it)."""

    authorization_endpoint: str
    token_endpoint: str
    resource: str = ""


@dataclass(frozen=True)
class TokenSet:
    """A token endpoint's answer. `refresh_token` is "" when it issued none."""

    access_token: str
    lifetime_s: float
    scopes: tuple[str, ...]
    refresh_token: str = ""


def pkce_pair() -> tuple[str, str]:
    """A fresh (code_verifier, S256 code_challenge)."""
    verifier = secrets.token_urlsafe(48)
    digest = hashlib.sha256(verifier.encode("ascii")).digest()
    return verifier, base64.urlsafe_b64encode(digest).decode("ascii").rstrip("=")


class McpOAuth:
    """The deployment's OAuth client for MCP servers: one client id and redirect URI (the
    gateway's consent callback), the outbound-target policy for token endpoints."""

    def __init__(self, client_id: str, redirect_uri: str, policy: TargetPolicy) -> None:
        self.client_id = client_id
        self.redirect_uri = redirect_uri
        self._policy = policy

    async def consent_url(
        self, endpoints: McpEndpoints, state: str, challenge: str, scopes: Sequence[str]
    ) -> str:
        """Where to send the person: the server's authorisation endpoint with the code flow's
        parameters. InvalidArgument when the metadata is not usable."""
        if not endpoints.authorization_endpoint or not endpoints.token_endpoint:
            raise InvalidArgument(
                "the MCP server published no authorisation or token endpoint; it cannot be "
                "connected with OAuth"
            )
        for url, what in (
            (endpoints.authorization_endpoint, "authorization endpoint"),
            (endpoints.token_endpoint, "token endpoint"),
        ):
            if not url.startswith(("https://", "http://")):
                raise InvalidArgument(f"the MCP server's {what} is not an http(s) URL")
        await check_url(endpoints.token_endpoint, self._policy, what="MCP token endpoint")
        query = {
            "response_type": "code",
            "client_id": self.client_id,
            "redirect_uri": self.redirect_uri,
            "state": state,
            "code_challenge": challenge,
            "code_challenge_method": "S256",
        }
        if scopes:
            query["scope"] = " ".join(scopes)
        if endpoints.resource:
            query["resource"] = endpoints.resource
        base = endpoints.authorization_endpoint
        return f"{base}{'&' if '?' in base else '?'}{urlencode(query)}"

    async def exchange(
        self, token_endpoint: str, client_id: str, code: str, verifier: str
    ) -> TokenSet:
        """The tokens for an authorisation code (FailedPrecondition when it is refused)."""
        return await self._token(
            token_endpoint,
            {
                "grant_type": "authorization_code",
                "code": code,
                "code_verifier": verifier,
                "client_id": client_id,
                "redirect_uri": self.redirect_uri,
            },
        )

    async def refresh(self, token_endpoint: str, client_id: str, refresh_token: str) -> TokenSet:
        """New tokens for a refresh token (FailedPrecondition when it is refused)."""
        return await self._token(
            token_endpoint,
            {"grant_type": "refresh_token", "refresh_token": refresh_token, "client_id": client_id},
        )

    async def _token(self, url: str, form: dict[str, str]) -> TokenSet:
        try:
            async with (
                target_session(self._policy, timeout=_TIMEOUT) as session,
                session.post(url, data=form, allow_redirects=False) as response,
            ):
                body = await response.content.read(_MAX_BODY)
                status = response.status
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            refused = refused_target(exc)
            if refused is not None:
                raise FailedPrecondition(
                    f"the MCP server's token endpoint is not an allowed target: {refused}",
                    code="mcp_refused_target",
                ) from None
            raise Unavailable("the MCP server's token endpoint is unreachable") from None
        if status >= 400:
            # The body may echo the code: it is not repeated.
            raise FailedPrecondition(
                f"the MCP server's token endpoint refused the grant (HTTP {status}); start the "
                "consent again",
                code="oauth_code_refused",
            )
        try:
            data = json.loads(body)
            access = str(data["access_token"])
        except (ValueError, KeyError, TypeError):
            raise FailedPrecondition(
                "the MCP server's token endpoint answered something that is not a token",
                code="oauth_code_refused",
            ) from None
        try:
            lifetime = float(data.get("expires_in", 3600))
        except (TypeError, ValueError):
            lifetime = 3600.0
        return TokenSet(
            access_token=access,
            lifetime_s=lifetime,
            scopes=tuple(str(data.get("scope") or "").split()),
            refresh_token=str(data.get("refresh_token") or ""),
        )
