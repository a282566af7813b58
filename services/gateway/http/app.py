"""The gateway's HTTP application: every set of routes (the bridges, sign-in, the console) on one
aiohttp application, with the errors' JSON shape, a server span per request while telemetry is
on, and the edge's rules on all of them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from aiohttp import web
from opentelemetry.trace import SpanKind

from services.gateway.http.edge import Edge
from services.gateway.http.errors import MAX_BODY_BYTES, BridgeRunner, errors
from tether import telemetry
from tether.telemetry import tracing


@web.middleware
async def traced(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """A request as a server span continuing the caller's `traceparent` header: its method,
    route template and status, never its body or its path's ids."""
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    with tracing.span(
        f"{request.method} {route}",
        parent=request.headers.get("traceparent", ""),
        kind=SpanKind.SERVER,
        attributes={"http.request.method": request.method, "http.route": route},
    ) as span:
        response = await handler(request)
        span.set_attribute("http.response.status_code", response.status)
        return response


def http_app(routes: Sequence[Routes], edge: Edge) -> web.Application:
    """The aiohttp application serving each of `routes`, with `edge`'s rules on all of them."""
    # Chosen once: while telemetry is on, each request is a server span.
    middlewares = [errors, traced] if telemetry.on else [errors]
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    for served in routes:
        served.add_routes(app)
    edge.install(app)
    return app


class Routes(Protocol):
    """A set of routes the gateway serves over HTTP."""

    def add_routes(self, app: web.Application) -> None: ...


async def start_http(
    app: web.Application, host: str, port: int, grace_s: float
) -> tuple[web.AppRunner, int]:
    """Serve `app`; returns the runner (clean it up to stop) and the bound port."""
    runner = BridgeRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, host, port, shutdown_timeout=grace_s)
    await site.start()
    address = runner.addresses[0]
    return runner, int(address[1])
