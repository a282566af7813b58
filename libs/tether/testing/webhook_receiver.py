"""A local HTTP endpoint that receives run-event webhooks, for tests and demos: it records every
request (headers and raw body) and answers with the statuses it is scripted to."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from aiohttp import web


@dataclass(frozen=True)
class Received:
    """One request as it arrived, and the status it was answered with."""

    headers: dict[str, str]
    body: bytes
    answered: int


class WebhookReceiver:
    """Answers the scripted statuses in turn (then `default`), recording each request."""

    def __init__(self, default: int = 200) -> None:
        self.default = default
        self.received: list[Received] = []
        self._script: deque[int] = deque()
        self._runner: web.AppRunner | None = None
        self.url = ""

    def script(self, statuses: Iterable[int]) -> None:
        """Answer the next requests with these statuses."""
        self._script.extend(statuses)

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        status = self._script.popleft() if self._script else self.default
        self.received.append(Received(dict(request.headers), body, status))
        return web.Response(status=status, text="ok" if status < 300 else "failing on purpose")

    async def start(self) -> None:
        """Listen on a free loopback port; `url` names the endpoint."""
        app = web.Application()
        app.router.add_post("/hook", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}/hook"

    async def stop(self) -> None:
        """Stop listening."""
        if self._runner is not None:
            await self._runner.cleanup()
