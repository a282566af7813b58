"""A local OAuth 2 provider for the demo toolkit and the tests: it consents at once.

`GET /authorize?client_id&state&redirect_uri&scope` redirects (302) to
`redirect_uri?state=...&code=...`; `POST /token` (form: code) answers
`{"access_token", "expires_in", "scope", "token_type"}`, once per code.

Out of process: `python -m tether.testing.oauth --port 0` prints
`oauth listening http://HOST:PORT`.
"""

from __future__ import annotations

import secrets
from urllib.parse import urlencode

from aiohttp import web

from tether.testing.local_server import LocalServer, run_cli


class OAuthServer(LocalServer):
    """Issues codes and tokens; `expires_in` is settable so tests can make tokens lapse."""

    name = "oauth"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, expires_in: int = 3600) -> None:
        super().__init__(host, port)
        self.expires_in = expires_in
        self._codes: dict[str, str] = {}

    def build_app(self) -> web.Application:
        """The routes."""
        app = web.Application()
        app.router.add_get("/authorize", self._authorize)
        app.router.add_post("/token", self._token)
        return app

    def code_for(self, scope: str) -> str:
        """Issue a code directly (what a person's browser would carry back)."""
        code = secrets.token_urlsafe(16)
        self._codes[code] = scope
        return code

    async def _authorize(self, request: web.Request) -> web.Response:
        redirect = request.query.get("redirect_uri", "")
        state = request.query.get("state", "")
        if not redirect or not state:
            return web.json_response({"error": "invalid_request"}, status=400)
        code = self.code_for(request.query.get("scope", ""))
        raise web.HTTPFound(f"{redirect}?{urlencode({'state': state, 'code': code})}")

    async def _token(self, request: web.Request) -> web.Response:
        form = await request.post()
        scope = self._codes.pop(str(form.get("code", "")), None)
        if scope is None:
            return web.json_response({"error": "invalid_grant"}, status=400)
        return web.json_response(
            {
                "access_token": "tok_" + secrets.token_urlsafe(16),
                "token_type": "bearer",
                "expires_in": self.expires_in,
                "scope": scope,
            }
        )


def main() -> None:
    """`python -m tether.testing.oauth [--host H] [--port P]`."""
    run_cli(__doc__, lambda args: OAuthServer(args.host, args.port))


if __name__ == "__main__":
    main()
