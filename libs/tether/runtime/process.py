"""Process lifecycle for every service: the event loop, signals, the ready file and graceful
stop (logging and telemetry are `tether.telemetry.setup`)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tether.runtime.rpc import RunningServer

log = logging.getLogger(__name__)


def run(main: Coroutine[Any, Any, None]) -> None:
    """Run a service's main coroutine on uvloop (libuv's loop: cheaper socket I/O and
    callbacks than the pure-Python selector loop), or on asyncio's own where it is missing."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    if os.environ.get("TETHER_EVENT_LOOP") == "asyncio":
        asyncio.run(main)
    else:
        uvloop.run(main)


def write_ready_file(path: str, port: int) -> None:
    """Atomically publish the bound port, so a supervisor learns it without parsing logs."""
    if not path:
        return
    target = Path(path)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(str(port))
    os.replace(tmp, target)


def companion_ready_file(path: str, name: str) -> str:
    """Where a process publishes a second port beside its ready file (`gateway.port` ->
    `gateway.http.port`); empty when there is no ready file."""
    if not path:
        return ""
    target = Path(path)
    return str(target.with_name(f"{target.stem}.{name}{target.suffix}"))


def announce(ready_file: str, served: RunningServer, **companions: int) -> None:
    """Publish a started server's ports: each companion (`http=PORT`) and the health-only
    port beside the ready file first, the gRPC port in it last (a supervisor reading the ready
    file finds the others already there)."""
    ports = dict(companions)
    if served.health_port is not None:
        ports["health"] = served.health_port
    for name, port in ports.items():
        write_ready_file(companion_ready_file(ready_file, name), port)
    write_ready_file(ready_file, served.port)


async def wait_for_signal(failed: asyncio.Event | None = None) -> None:
    """Return on SIGTERM or SIGINT, or when `failed` is set (a supervised task died)."""
    stop = failed or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def serve(
    server: RunningServer,
    *,
    grace: float,
    cleanups: list[Callable[[], Awaitable[None]]],
    failed: asyncio.Event | None = None,
) -> None:
    """Serve until signalled (or a supervised task dies), then stop accepting, drain for
    `grace` seconds and clean up."""
    await wait_for_signal(failed)
    log.info("stopping (grace %.1fs)", grace)
    await server.stop(grace)
    for cleanup in reversed(cleanups):
        await cleanup()
