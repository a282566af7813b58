"""A local MCP server over streamable HTTP, built with the official SDK's own server (`MCPServer`).

Point the SDK's client (or the worker's) at `server.url` and script it per test. In process::

    async with McpServer() as mcp:                    # or McpServer(auth={"bearer": "s3cret"})
        ...                                           # or McpServer(auth="oauth")
        assert mcp.ledger.executions["cancel_order"] == 1
        await mcp.wait_until(lambda ledger: ledger.slow_started == 1)
        mcp.release_slow()                            # the slow tool answers
        await mcp.restart()                           # same port; every session is lost
        mcp.mode = "garbage"                          # answers 200 with a body that is not JSON-RPC

Tools: `lookup_order(order_id)` (readOnlyHint), `cancel_order(order_id)` (destructiveHint),
`email_receipt(order_id, to)` (openWorldHint), `slow_report(topic)` (waits until released or
cancelled). A call carrying `_meta[tether.mcp_wire.IDEMPOTENCY_KEY_META]` runs once per key:
the same key again answers the stored result (or the stored tool error) without running the
tool. The ledger (executions per tool and per key, cancel notifications seen, the orders) lives
outside the sessions and survives a restart, as a server's database would.

Out of process: `python -m tether.testing.mcp_server --port 0 [--bearer S | --oauth]` prints
`mcp listening http://HOST:PORT/mcp`; read `GET /_state`, `POST /_release`, `POST /_mode`
(`{"mode": "ok" | "garbage" | "unavailable"}`), `POST /_restart` (drops every session, as a
restart does), `POST /_reset`. Down is a stopped server (`stop()`, or the process ended).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, ClassVar, Literal

import uvicorn
from mcp.server.auth.settings import AuthSettings, ClientRegistrationOptions
from mcp.server.context import CallNext, ServerRequestContext
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from tether.mcp_wire import IDEMPOTENCY_KEY_META
from tether.testing.local_server import LocalServer
from tether.testing.mcp_auth import SCOPE, BearerVerifier, OAuthProvider
from tether.testing.mcp_ledger import McpLedger

__all__ = ["McpLedger", "McpServer", "Mode", "main"]

Mode = Literal["ok", "garbage", "unavailable"]
MODES: tuple[Mode, ...] = ("ok", "garbage", "unavailable")
DEFAULT_REDIRECT_URIS = ("http://127.0.0.1/oauth/callback",)
MCP_PATH = "/mcp"


class _QuietUvicorn(uvicorn.Server):
    """uvicorn without its signal handlers: the host process (a test, or `serve` below) owns
    SIGINT and SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


class McpServer(LocalServer):
    """The stand-in; `auth` is None, `{"bearer": SECRET}` or `"oauth"`."""

    name: ClassVar[str] = "mcp"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        auth: str | Mapping[str, str] | None = None,
        redirect_uris: Sequence[str] = DEFAULT_REDIRECT_URIS,
    ) -> None:
        super().__init__(host, port)
        if auth is not None and auth != "oauth" and set(auth) != {"bearer"}:
            raise ValueError('auth is None, {"bearer": SECRET} or "oauth"')
        self._auth = auth
        self.oauth = OAuthProvider(list(redirect_uris)) if auth == "oauth" else None
        self.ledger = McpLedger()
        self.mode: Mode = "ok"
        self._release = asyncio.Event()
        self._changed = asyncio.Event()
        self._uvicorn: _QuietUvicorn | None = None
        self._serving: asyncio.Task[None] | None = None
        self._inner: ASGIApp | None = None
        self._sessions_end: asyncio.Event | None = None
        self._sessions: asyncio.Task[None] | None = None
        self._control = self._control_routes()

    @property
    def url(self) -> str:
        """The MCP endpoint, `http://HOST:PORT/mcp`."""
        return self.base_url + MCP_PATH

    # Lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind (port 0 picks a free one; a restart binds the same one) and serve."""
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        # IPPROTO_TCP named, so asyncio turns Nagle off on every accepted connection (it checks
        # the protocol): else a reused connection's response body waits ~40 ms for the client's
        # delayed acknowledgement of its headers.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self._host, self._port))
        sock.listen(128)
        sock.setblocking(False)
        self._port = int(sock.getsockname()[1])
        await self._open_sessions()
        config = uvicorn.Config(
            self._front,
            lifespan="off",
            interface="asgi3",
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=2,
        )
        server = _QuietUvicorn(config)
        self._uvicorn = server
        self._serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if self._serving.done():
                await self._serving
                raise RuntimeError("the MCP stand-in stopped while starting")
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        """Stop serving: every session ends (its calls are cancelled), then the listener."""
        await self._close_sessions()
        if self._uvicorn is not None and self._serving is not None:
            self._uvicorn.should_exit = True
            await self._serving
        self._uvicorn = None
        self._serving = None

    async def restart(self) -> None:
        """Stop and start again on the same port: the ledger stays, every session is lost."""
        await self.stop()
        await self.start()

    async def drop_sessions(self) -> None:
        """What a client sees of a restart between two requests, without unbinding: every
        session id known so far answers 404 from now on."""
        await self._close_sessions()
        await self._open_sessions()

    async def _open_sessions(self) -> None:
        app = self._build()
        inner = app.streamable_http_app(streamable_http_path=MCP_PATH, host=self._host)
        ready = asyncio.Event()
        end = asyncio.Event()

        async def hold() -> None:
            async with app.session_manager.run():
                ready.set()
                await end.wait()

        self._sessions_end = end
        self._sessions = asyncio.create_task(hold())
        ready_wait = asyncio.create_task(ready.wait())
        await asyncio.wait({ready_wait, self._sessions}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.is_set():
            ready_wait.cancel()
            await self._sessions
        self._inner = inner

    async def _close_sessions(self) -> None:
        self._inner = None
        if self._sessions_end is not None and self._sessions is not None:
            self._sessions_end.set()
            await self._sessions
        self._sessions_end = None
        self._sessions = None

    # Scripting ----------------------------------------------------------------------------

    def release_slow(self) -> None:
        """Every `slow_report` call waiting, and every later one, answers."""
        self._release.set()

    def reset(self) -> None:
        """A fresh ledger, mode ok, the slow tool held again."""
        self.ledger = McpLedger()
        self.mode = "ok"
        self._release = asyncio.Event()
        self._notify()

    async def wait_until(
        self, predicate: Callable[[McpLedger], bool], within_s: float = 10
    ) -> None:
        """Until `predicate(ledger)` holds; AssertionError after `within_s` seconds."""
        try:
            async with asyncio.timeout(within_s):
                while not predicate(self.ledger):
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            raise AssertionError(
                f"the MCP stand-in's ledger did not get there: {self.ledger}"
            ) from None

    def _notify(self) -> None:
        self._changed.set()

    # The MCP server ---------------------------------------------------------------------

    def _build(self) -> MCPServer[Any]:
        auth: AuthSettings | None = None
        verifier: BearerVerifier | None = None
        if self._auth is not None:
            auth = AuthSettings(
                issuer_url=self.base_url,
                resource_server_url=self.url,
                required_scopes=[SCOPE],
                validate_token_resource=False,
                client_registration_options=ClientRegistrationOptions(
                    enabled=True, valid_scopes=[SCOPE], default_scopes=[SCOPE]
                ),
            )
            if isinstance(self._auth, Mapping):
                verifier = BearerVerifier(self._auth["bearer"])
        app: MCPServer[Any] = MCPServer(
            "tether-stand-in",
            auth=auth,
            token_verifier=verifier,
            auth_server_provider=self.oauth,
            middleware=[self._observe],
            log_level="WARNING",
        )
        read = ToolAnnotations(read_only_hint=True, open_world_hint=False)
        destroy = ToolAnnotations(
            read_only_hint=False, destructive_hint=True, open_world_hint=False
        )
        share = ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=True)

        @app.tool(annotations=read, description="An order's status and total.")
        async def lookup_order(order_id: str, ctx: Context) -> str:
            return await self._once(ctx, "lookup_order", lambda: self._lookup(order_id))

        @app.tool(annotations=destroy, description="Cancel an order; it cannot be undone.")
        async def cancel_order(order_id: str, ctx: Context) -> str:
            return await self._once(ctx, "cancel_order", lambda: self._cancel(order_id))

        @app.tool(annotations=share, description="Email an order's receipt to an address.")
        async def email_receipt(order_id: str, to: str, ctx: Context) -> str:
            return await self._once(ctx, "email_receipt", lambda: self._email(order_id, to))

        @app.tool(description="A report that takes until it is released.")
        async def slow_report(topic: str, ctx: Context) -> str:
            return await self._once(ctx, "slow_report", lambda: self._slow(topic))

        return app

    async def _observe(self, ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> Any:
        if ctx.method == "notifications/cancelled":
            params = ctx.params or {}
            self.ledger.cancel_notifications.append(params.get("requestId"))
            self._notify()
        elif ctx.method == "initialize":
            self.ledger.initializations += 1
            self._notify()
        elif ctx.method == "tools/list":
            self.ledger.listings += 1
            self._notify()
        return await call_next(ctx)

    async def _once(self, ctx: Context, tool: str, work: Callable[[], Awaitable[str]]) -> str:
        meta = ctx.request_context.meta or {}
        key = meta.get(IDEMPOTENCY_KEY_META)
        if not isinstance(key, str) or not key:
            return await self._count(tool, None, work)
        async with self.ledger.lock(key):
            stored = self.ledger.results.get(key)
            if stored is not None:
                self.ledger.replays[key] = self.ledger.replays.get(key, 0) + 1
                self._notify()
                if stored.error:
                    raise ToolError(stored.text)
                return stored.text
            try:
                text = await self._count(tool, key, work)
            except ToolError as exc:
                self.ledger.store(key, tool, str(exc), error=True)
                raise
            self.ledger.store(key, tool, text, error=False)
            return text

    async def _count(self, tool: str, key: str | None, work: Callable[[], Awaitable[str]]) -> str:
        self.ledger.executed(tool, key)
        self._notify()
        return await work()

    async def _lookup(self, order_id: str) -> str:
        order = self.ledger.orders.get(order_id)
        if order is None:
            raise ToolError(f"no order {order_id}")
        return json.dumps({"order_id": order_id, **order}, sort_keys=True)

    async def _cancel(self, order_id: str) -> str:
        order = self.ledger.orders.get(order_id)
        if order is None:
            raise ToolError(f"no order {order_id}")
        order["status"] = "cancelled"
        return json.dumps({"order_id": order_id, "status": "cancelled"})

    async def _email(self, order_id: str, to: str) -> str:
        if order_id not in self.ledger.orders:
            raise ToolError(f"no order {order_id}")
        self.ledger.emails.append((order_id, to))
        return f"receipt for {order_id} sent to {to}"

    async def _slow(self, topic: str) -> str:
        self.ledger.slow_started += 1
        self._notify()
        try:
            await self._release.wait()
        except asyncio.CancelledError:
            self.ledger.slow_interrupted += 1
            self._notify()
            raise
        return f"report on {topic}"

    # HTTP front: control routes, scripted faults, then the SDK's app -------------------------

    async def _front(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path.startswith("/_"):
            await self._control(scope, receive, send)
            return
        if scope["type"] == "http" and path == MCP_PATH and self.mode != "ok":
            if self.mode == "garbage":
                response = Response(b'{"jsonrpc": "2.0", "id": ', media_type="application/json")
            else:
                response = Response(b"unavailable", status_code=503, media_type="text/plain")
            await response(scope, receive, send)
            return
        client = scope.get("client")
        if scope["type"] == "http" and scope["method"] == "POST" and client is not None:
            self.ledger.post_connections.add((client[0], client[1]))
        inner = self._inner
        if inner is None:
            await Response(b"restarting", status_code=503)(scope, receive, send)
            return
        await inner(scope, receive, send)

    def _control_routes(self) -> Starlette:
        async def state(request: Request) -> Response:
            return JSONResponse(self.ledger.to_json() | {"mode": self.mode})

        async def release(request: Request) -> Response:
            self.release_slow()
            return JSONResponse({})

        async def mode(request: Request) -> Response:
            body = await request.json()
            if body.get("mode") not in MODES:
                return JSONResponse({"error": f"mode is one of {', '.join(MODES)}"}, 400)
            self.mode = body["mode"]
            return JSONResponse({})

        async def restart(request: Request) -> Response:
            await self.drop_sessions()
            return JSONResponse({})

        async def reset(request: Request) -> Response:
            self.reset()
            return JSONResponse({})

        return Starlette(
            routes=[
                Route("/_state", state, methods=["GET"]),
                Route("/_release", release, methods=["POST"]),
                Route("/_mode", mode, methods=["POST"]),
                Route("/_restart", restart, methods=["POST"]),
                Route("/_reset", reset, methods=["POST"]),
            ]
        )


# Command line ---------------------------------------------------------------------------------


async def _serve(server: McpServer) -> None:
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    sys.stdout.write(f"{server.name} listening {server.url}\n")
    sys.stdout.flush()
    try:
        await stop.wait()
    finally:
        await server.stop()


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m tether.testing.mcp_server [--host H] [--port P] [--bearer S | --oauth]`."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--bearer", help="accept only this bearer token")
    group.add_argument("--oauth", action="store_true", help="require an OAuth access token")
    args = parser.parse_args(argv)
    auth: str | dict[str, str] | None = None
    if args.bearer:
        auth = {"bearer": args.bearer}
    elif args.oauth:
        auth = "oauth"
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(McpServer(args.host, args.port, auth=auth)))


if __name__ == "__main__":
    main()
