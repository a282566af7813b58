"""Browser sign-in: the console's session cookie (with its CSRF token) and embedding apps'
short-lived tokens, both minted from an API key (services.gateway.browser_credentials).

    POST   /v2/session   {"apiKey": "tk_..."} -> 201, Set-Cookie and the session's body
    GET    /v2/session   the session's body while the cookie is valid, else 401
    DELETE /v2/session   revokes the session server-side and clears the cookie (CSRF checked)
    POST   /v2/tokens    Authorization: Bearer <API key>, {"ttlSeconds"?, "scopes"?} -> 201

A request authenticates with its `Authorization` header when it has one, else with the cookie;
a cookie-authenticated mutation needs the session's CSRF token (`X-CSRF-Token`) and, when the
browser sends `Origin`, a same-origin one (`require_csrf`).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from sqlalchemy.ext.asyncio import AsyncEngine

from services.gateway import browser_credentials
from services.gateway.auth import Authenticator, SessionSecret, is_utf8
from services.gateway.browser_credentials import SESSION_PREFIX, csrf_token
from services.gateway.http.common import authorization_header
from tether.apikeys import ALL_SCOPES, Principal
from tether.errors import InvalidArgument, PermissionDenied, Unauthenticated

COOKIE = "tether_session"
CSRF_HEADER = "X-CSRF-Token"
MUTATIONS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
DEFAULT_TOKEN_TTL_S = 300
_SIGNED_OUT = Unauthenticated("not signed in: POST /v2/session with an API key first")


@dataclass(frozen=True)
class SignInPolicy:
    """How long sessions and tokens last (from the gateway's settings)."""

    session_ttl_s: int = 12 * 3600
    token_max_ttl_s: int = 3600


def _session_cookie(request: web.Request) -> str:
    value = request.cookies.get(COOKIE, "")
    if not value.startswith(SESSION_PREFIX) or len(value) >= 200 or not is_utf8(value):
        return ""  # no session of ours: a cookie's bytes that are not UTF-8 never were one
    return value


def credential(request: web.Request) -> str:
    """The `authorization` a v2 request authenticates with: its header when present, else its
    session cookie (as a SessionSecret, the only form the authenticator takes a session in),
    else ""."""
    authorization = authorization_header(request)
    if authorization:
        return authorization
    cookie = _session_cookie(request)
    return SessionSecret("Bearer " + cookie) if cookie else ""


def require_csrf(request: web.Request) -> None:
    """Refuse a cookie-authenticated mutation without the session's CSRF token or from another
    origin (PERMISSION_DENIED, before anything runs)."""
    if request.method not in MUTATIONS or authorization_header(request):
        return
    cookie = _session_cookie(request)
    if not cookie:
        return  # not a session: the route answers 401 itself
    origin = request.headers.get("Origin")
    if origin is not None and urlsplit(origin).netloc.lower() != request.host.lower():
        raise PermissionDenied(
            "a signed-in browser's request must come from the console's own origin",
            code="cross_origin",
        )
    sent = request.headers.get(CSRF_HEADER, "")
    if not sent:
        raise PermissionDenied(
            f"missing the {CSRF_HEADER} header: a signed-in browser's POST, PUT, PATCH or "
            "DELETE sends the csrfToken from /v2/session",
            code="csrf_required",
        )
    if not hmac.compare_digest(sent.encode(errors="replace"), csrf_token(cookie).encode()):
        raise PermissionDenied(
            f"the {CSRF_HEADER} header does not match this session's csrfToken",
            code="csrf_mismatch",
        )


def _is_loopback(request: web.Request) -> bool:
    host = request.url.host or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _session_body(secret: str, principal: Principal, expires_at: datetime) -> dict[str, Any]:
    return {
        "csrfToken": csrf_token(secret),
        "expiresAt": _rfc3339(expires_at),
        "tenantId": principal.tenant_id,
        "principal": principal.principal_id,
        "scopes": sorted(principal.scopes),
    }


def _rfc3339(when: datetime) -> str:
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


async def _json_object(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InvalidArgument("the request body is not a valid JSON object") from exc
    if not isinstance(data, dict):
        raise InvalidArgument(f"the request body must be a JSON object, not {type(data).__name__}")
    return data


def _only(data: dict[str, Any], known: set[str]) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        raise InvalidArgument(f"unknown fields {unknown}; this route takes {sorted(known)}")


class SignIn:
    """The session and token routes."""

    def __init__(
        self,
        auth: Authenticator,
        engine: AsyncEngine,
        policy: SignInPolicy,
        sweep: browser_credentials.Sweep | None = None,
    ) -> None:
        self._auth = auth
        self._engine = engine
        self._policy = policy
        self._sweep = sweep

    def _minted(self, ttl_s: float) -> None:
        if self._sweep is not None:
            self._sweep.minted(ttl_s)

    def add_routes(self, app: web.Application) -> None:
        """Add the routes to `app`."""
        app.router.add_post("/v2/session", self.open_session)
        app.router.add_get("/v2/session", self.read_session)
        app.router.add_delete("/v2/session", self.close_session)
        app.router.add_post("/v2/tokens", self.mint_token)

    async def open_session(self, request: web.Request) -> web.Response:
        data = await _json_object(request)
        _only(data, {"apiKey", "api_key"})
        api_key = data.get("apiKey", data.get("api_key", ""))
        if not isinstance(api_key, str) or not api_key:
            raise InvalidArgument('the body must be {"apiKey": "tk_..."}')
        key = await self._auth.verify_key(api_key)
        async with self._engine.begin() as conn:
            secret, session = await browser_credentials.mint(
                conn, "session", key, key.scopes, self._policy.session_ttl_s
            )
        self._minted(self._policy.session_ttl_s)
        response = web.json_response(
            _session_body(secret, session.principal, session.expires_at), status=201
        )
        response.set_cookie(
            COOKIE,
            secret,
            max_age=self._policy.session_ttl_s,
            path="/",
            httponly=True,
            samesite="Strict",
            secure=not _is_loopback(request),
        )
        return response

    async def _session(self, request: web.Request) -> tuple[str, Principal]:
        cookie = _session_cookie(request)
        if not cookie:
            raise _SIGNED_OUT
        return cookie, await self._auth.verify_session(cookie)

    async def read_session(self, request: web.Request) -> web.Response:
        cookie, principal = await self._session(request)
        assert principal.expires_at is not None  # a session always expires
        return web.json_response(_session_body(cookie, principal, principal.expires_at))

    async def close_session(self, request: web.Request) -> web.Response:
        cookie, _ = await self._session(request)
        async with self._engine.begin() as conn:
            await browser_credentials.revoke(conn, cookie, "session")
        self._auth.forget_secret(cookie)  # this replica at once; the others within their TTL
        response = web.Response(status=204)
        response.del_cookie(COOKIE, path="/")
        return response

    async def mint_token(self, request: web.Request) -> web.Response:
        authorization = authorization_header(request)
        if not authorization.startswith("Bearer "):
            raise Unauthenticated("a token is minted with an API key: Authorization: Bearer tk_")
        key = await self._auth.verify_key(authorization.removeprefix("Bearer ").strip())
        data = await _json_object(request)
        _only(data, {"ttlSeconds", "ttl_seconds", "scopes"})
        ttl = data.get("ttlSeconds", data.get("ttl_seconds", DEFAULT_TOKEN_TTL_S))
        maximum = self._policy.token_max_ttl_s
        if isinstance(ttl, str) and ttl.isascii() and ttl.isdigit():
            ttl = int(ttl)  # protobuf's JSON writes integers as strings too
        if not isinstance(ttl, int) or isinstance(ttl, bool) or not 1 <= ttl <= maximum:
            raise InvalidArgument(f"ttlSeconds must be an integer from 1 to {maximum}")
        scopes = data.get("scopes") or sorted(key.scopes)
        if not isinstance(scopes, list) or not all(isinstance(s, str) for s in scopes):
            raise InvalidArgument("scopes must be a list of scope names")
        unknown = sorted(set(scopes) - set(ALL_SCOPES))
        if unknown:
            raise InvalidArgument(f"unknown scopes {unknown}; known scopes are {list(ALL_SCOPES)}")
        wider = sorted(set(scopes) - key.scopes)
        if wider:
            raise PermissionDenied(
                f"a token cannot carry scopes its API key does not hold: {wider}"
            )
        async with self._engine.begin() as conn:
            secret, token = await browser_credentials.mint(conn, "token", key, scopes, ttl)
        self._minted(ttl)
        return web.json_response(
            {
                "token": secret,
                "expiresAt": _rfc3339(token.expires_at),
                "scopes": sorted(token.principal.scopes),
            },
            status=201,
        )
