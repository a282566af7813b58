"""A local OAuth 2 provider for the demo toolkit and the tests: it consents at once.

`GET /authorize?client_id&state&redirect_uri&scope` redirects (302) to
`redirect_uri?state=...&code=...`; `POST /token` (form: code) answers
`{"access_token", "expires_in", "scope", "token_type"}`, once per code.

Out of process: `python -m tether.testing.oauth --port 0` prints
`oauth listening http://HOST:PORT`.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import signal
from urllib.parse import urlencode

from aiohttp import web


class OAuthServer:
    """Issues codes and tokens; `expires_in` is settable so tests can make tokens lapse."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, expires_in: int = 3600) -> None:
        self._host, self._port = host, port
        self.expires_in = expires_in
        self._codes: dict[str, str] = {}
        self._runner: web.AppRunner | None = None

    @property
    def base_url(self) -> str:
        """Where it listens."""
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        """Bind and serve."""
        app = web.Application()
        app.router.add_get("/authorize", self._authorize)
        app.router.add_post("/token", self._token)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        server = site._server
        assert server is not None
        self._port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]

    async def stop(self) -> None:
        """Stop serving."""
        if self._runner is not None:
            await self._runner.cleanup()

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


async def _serve(host: str, port: int) -> None:
    server = OAuthServer(host, port)
    await server.start()
    print(f"oauth listening {server.base_url}", flush=True)  # noqa: T201
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()


def main() -> None:
    """CLI entry."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    asyncio.run(_serve(args.host, args.port))


if __name__ == "__main__":
    main()
