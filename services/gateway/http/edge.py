"""The rules every HTTP request and response meets at the gateway's edge, whatever its route:
no credentials in URLs, CSRF on a signed-in browser's mutations, CORS only for configured
origins, and the security headers (no-store on the API, a strict CSP on the console)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

from aiohttp import web

from services.gateway.http.errors import error_response
from services.gateway.http.signin import require_csrf
from tether.errors import InvalidArgument, TetherError

# Query parameters that would carry a credential (compared case-insensitively).
CREDENTIAL_PARAMETERS = frozenset(
    {"key", "api_key", "apikey", "token", "access_token", "session", "authorization"}
)
CORS_METHODS = "GET, POST, DELETE"
CORS_HEADERS = "Authorization, Content-Type, Last-Event-ID, Idempotency-Key, Tether-Tenant"
# How long a browser may reuse a preflight's answer.
CORS_MAX_AGE_S = 600
CONSOLE_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
_API = ("/v1/", "/v2/")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _is_api(path: str) -> bool:
    return path.startswith(_API) or path in ("/v1", "/v2")


def _is_console(path: str) -> bool:
    return path == "/console" or path.startswith("/console/")


class Edge:
    """The edge rules, as a middleware (refusals) and a response hook (headers)."""

    def __init__(self, cors_origins: Iterable[str] = ()) -> None:
        self._origins = frozenset(o.strip().rstrip("/") for o in cors_origins if o.strip())

    def install(self, app: web.Application) -> None:
        """Put the rules on `app` (the middleware first, so it sees every route's answer)."""
        app.middlewares.insert(0, self.middleware)
        app.on_response_prepare.append(self._headers)

    def _allowed(self, request: web.BaseRequest) -> str | None:
        origin = request.headers.get("Origin")
        if origin is not None and origin in self._origins and request.path.startswith("/v2/"):
            return origin
        return None

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Refuse credentials in the URL; answer CORS preflights; check CSRF."""
        try:
            return await self._checked(request, handler)
        except TetherError as exc:
            return error_response(exc)

    async def _checked(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if any(name.lower() in CREDENTIAL_PARAMETERS for name in request.query):
            raise InvalidArgument(
                "credentials are never accepted in a URL; send Authorization: Bearer ...",
                code="credentials_in_url",
            )
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            origin = self._allowed(request)
            if origin is None:
                return web.Response(status=204)  # no CORS headers: the browser refuses
            return web.Response(
                status=204,
                headers={
                    "Access-Control-Allow-Methods": CORS_METHODS,
                    "Access-Control-Allow-Headers": CORS_HEADERS,
                    "Access-Control-Max-Age": str(CORS_MAX_AGE_S),
                },
            )
        signing_in = request.path == "/v2/session" and request.method == "POST"
        if request.path.startswith("/v2/") and not signing_in:
            require_csrf(request)  # sign-in authenticates with the body's key, not the cookie
        return await handler(request)

    async def _headers(self, request: web.BaseRequest, response: web.StreamResponse) -> None:
        headers = response.headers
        headers["X-Content-Type-Options"] = "nosniff"
        headers["Referrer-Policy"] = "no-referrer"
        path = request.path
        if _is_api(path):
            headers["Cache-Control"] = "no-store"
        elif _is_console(path):
            headers["Content-Security-Policy"] = CONSOLE_CSP
            headers["X-Frame-Options"] = "DENY"
        origin = self._allowed(request)
        if origin is not None:
            headers["Access-Control-Allow-Origin"] = origin
            headers["Access-Control-Expose-Headers"] = "WWW-Authenticate"
            headers.add("Vary", "Origin")
