"""What an MCP server that answered 401/403 wants, read as the MCP authorisation specification
describes it: the `WWW-Authenticate` challenge, the server's protected-resource metadata
(RFC 9728) and its authorisation server's metadata (RFC 8414); and the PKCE (S256)
authorisation URL a connection pause sends a person to. Discovery never raises: what could not be
read is left empty in the challenge."""

from __future__ import annotations

import base64
import hashlib
import re
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urlencode, urlsplit

import httpx2

from services.worker.mcp.outcome import AuthChallenge

MAX_METADATA_BYTES = 64 * 1024
_PARAM = re.compile(r'(\w+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s,]+))')


def challenge_params(header: str) -> dict[str, str]:
    """The auth-params of a `Bearer` challenge (`error`, `scope`, `resource_metadata`, ...)."""
    scheme, _, rest = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return {}
    return {
        m.group(1).lower(): m.group(2) if m.group(2) is not None else m.group(3) or ""
        for m in _PARAM.finditer(rest)
    }


async def discover(
    http: httpx2.AsyncClient,
    url: str,
    status: int,
    header: str,
    *,
    token_sent: bool,
    allowed: Callable[[str], Awaitable[bool]] | None = None,
) -> AuthChallenge:
    """The challenge of a 401/403 answered to `url`, with whatever metadata can be read (a
    metadata URL `allowed` refuses is not fetched: the server names it, not the agent)."""
    params = challenge_params(header)
    error = params.get("error", "")
    if status == 403 or error == "insufficient_scope":
        gap = "insufficient_scope"
    else:
        gap = "expired" if token_sent else "absent"
    metadata_url = params.get("resource_metadata", "") or _well_known(
        url, "oauth-protected-resource"
    )
    resource = await _json(http, metadata_url, allowed)
    servers = tuple(str(s) for s in _list(resource.get("authorization_servers")))
    scopes = params.get("scope", "").split() or [
        str(s) for s in _list(resource.get("scopes_supported"))
    ]
    issuer: Mapping[str, Any] = {}
    if servers:
        issuer = await _json(http, _well_known(servers[0], "oauth-authorization-server"), allowed)
        if not issuer:
            issuer = await _json(http, _well_known(servers[0], "openid-configuration"), allowed)
    return AuthChallenge(
        status=status,
        gap=gap,
        error=error,
        scopes=tuple(scopes),
        resource_metadata_url=metadata_url if resource else "",
        resource=str(resource.get("resource", "")),
        authorization_servers=servers,
        issuer=str(issuer.get("issuer", "")),
        authorization_endpoint=str(issuer.get("authorization_endpoint", "")),
        token_endpoint=str(issuer.get("token_endpoint", "")),
        registration_endpoint=str(issuer.get("registration_endpoint", "")),
        code_challenge_methods=tuple(
            str(m) for m in _list(issuer.get("code_challenge_methods_supported"))
        ),
    )


def pkce_pair() -> tuple[str, str]:
    """A fresh (code_verifier, S256 code_challenge)."""
    verifier = secrets.token_urlsafe(48)
    return verifier, code_challenge(verifier)


def code_challenge(verifier: str) -> str:
    """The S256 challenge of a PKCE verifier."""
    digest = hashlib.sha256(verifier.encode("ascii")).digest()
    return base64.urlsafe_b64encode(digest).decode("ascii").rstrip("=")


def authorization_url(
    challenge: AuthChallenge,
    *,
    client_id: str,
    redirect_uri: str,
    state: str,
    code_verifier: str,
    scopes: Sequence[str] = (),
) -> str:
    """Where to send a person to authorise: the authorisation endpoint with the code flow's
    parameters, PKCE S256 and the RFC 8707 resource. ValueError when the server published no
    authorisation endpoint."""
    if not challenge.authorization_endpoint:
        raise ValueError("the MCP server published no authorisation endpoint")
    query = {
        "response_type": "code",
        "client_id": client_id,
        "redirect_uri": redirect_uri,
        "state": state,
        "code_challenge": code_challenge(code_verifier),
        "code_challenge_method": "S256",
    }
    wanted = list(scopes) or list(challenge.scopes)
    if wanted:
        query["scope"] = " ".join(wanted)
    if challenge.resource:
        query["resource"] = challenge.resource
    separator = "&" if "?" in challenge.authorization_endpoint else "?"
    return f"{challenge.authorization_endpoint}{separator}{urlencode(query)}"


def _well_known(url: str, name: str) -> str:
    """RFC 8414/9728's well-known URL for `url`: the suffix after the origin, the path after."""
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    return f"{parts.scheme}://{parts.netloc}/.well-known/{name}{path}"


async def _json(
    http: httpx2.AsyncClient, url: str, allowed: Callable[[str], Awaitable[bool]] | None
) -> Mapping[str, Any]:
    """A metadata document, or {} when it cannot be read as a JSON object."""
    if not url.startswith(("https://", "http://")):
        return {}
    if allowed is not None and not await allowed(url):
        return {}
    try:
        response = await http.get(url, headers={"accept": "application/json"})
        if response.status_code != 200 or len(response.content) > MAX_METADATA_BYTES:
            return {}
        data = response.json()
    except (httpx2.HTTPError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []
