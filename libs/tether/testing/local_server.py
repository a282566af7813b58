"""What the local stand-in servers share (model server, ledger, OAuth provider): an aiohttp app
on loopback with start/stop, `async with`, its address, and a command line that announces
`NAME listening URL` on stdout (callers that start one as a subprocess read the port from it)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, ClassVar, Self

from aiohttp import web


class LocalServer:
    """Subclasses provide `build_app()` and a `name`; `start()` binds (port 0 picks a free
    one) and `stop()` ends every response."""

    name: ClassVar[str]

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._host = host
        self._port = port
        self._runner: web.AppRunner | None = None

    def build_app(self) -> web.Application:
        """The routes."""
        raise NotImplementedError

    def runner_options(self) -> dict[str, Any]:
        """Options for the aiohttp runner."""
        return {"access_log": None}

    async def start(self) -> None:
        """Bind and begin serving."""
        runner = web.AppRunner(self.build_app(), **self.runner_options())
        await runner.setup()
        await web.TCPSite(runner, self._host, self._port).start()
        self._runner = runner
        self._port = int(runner.addresses[0][1])

    async def stop(self) -> None:
        """Stop serving."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    @property
    def base_url(self) -> str:
        """`http://HOST:PORT`."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._port}"

    @property
    def port(self) -> int:
        """The bound port (the real one once started with port 0)."""
        return self._port


async def serve(server: LocalServer) -> None:
    """Serve until SIGTERM or SIGINT, announcing the address on stdout."""
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    sys.stdout.write(f"{server.name} listening {server.base_url}\n")
    sys.stdout.flush()
    try:
        await stop.wait()
    finally:
        await server.stop()


def run_cli(
    doc: str | None,
    make: Callable[[argparse.Namespace], LocalServer],
    argv: Sequence[str] | None = None,
    *,
    extra: Callable[[argparse.ArgumentParser], object] | None = None,
) -> argparse.Namespace:
    """`python -m ... [--host H] [--port P]`: parse, build the server with `make`, serve."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    if extra is not None:
        extra(parser)
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(make(args)))
    return args
