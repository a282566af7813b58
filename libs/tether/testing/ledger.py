"""A test-only external system that records side effects and deduplicates on Idempotency-Key.

It stands in for the world a tool writes to, so tests can count what actually arrived::

    async with Ledger() as ledger:
        ...  # point publish_post at ledger.base_url (TETHER_LEDGER_URL)
        assert len(ledger.records) == 1 and ledger.deliveries(key) == 2

- `POST /effects` with an `Idempotency-Key` header: the first request for a key is recorded and
  answered 201 `{"id": ..., "replayed": false}`; every later one is answered 200 with the same
  id and `"replayed": true` and not recorded again. Without the header every request is
  recorded, so a tool that forgot the key shows up as a double write.
- `GET /effects`: `{"records": [{id, key, body, received_at}], "deliveries": {key: count}}`,
  where `deliveries` counts every POST that arrived per key (replays included).
- `POST /_reset`: forget everything.

Out of process: `python -m tether.testing.ledger --port 0` prints
`ledger listening http://HOST:PORT`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

from aiohttp import web

KEY_HEADER = "Idempotency-Key"


@dataclass(frozen=True)
class LedgerRecord:
    """One recorded effect; `key` is None for a request that carried no Idempotency-Key."""

    id: str
    key: str | None
    body: Any
    received_at: str


class Ledger:
    """The server. `start()` binds (port 0 picks a free one); `stop()` closes it."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._host = host
        self._port = port
        self._records: list[LedgerRecord] = []
        self._by_key: dict[str, LedgerRecord] = {}
        self._deliveries: Counter[str] = Counter()
        self._runner: web.AppRunner | None = None
        # Cleared by a test to hold responses after recording: the effect has happened but
        # the caller has not heard back (the moment a crash makes a duplicate likely).
        self.respond = asyncio.Event()
        self.respond.set()
        self.recorded = asyncio.Event()

    async def start(self) -> None:
        """Bind and begin serving."""
        app = web.Application()
        app.router.add_post("/effects", self._post_effect)
        app.router.add_get("/effects", self._get_effects)
        app.router.add_post("/_reset", self._post_reset)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, self._host, self._port).start()
        self._runner = runner
        self._port = int(runner.addresses[0][1])

    async def stop(self) -> None:
        """Stop serving; the records stay readable."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> Ledger:
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
    def records(self) -> list[LedgerRecord]:
        """A copy of the recorded effects, oldest first."""
        return list(self._records)

    def deliveries(self, key: str) -> int:
        """How many POSTs arrived carrying `key`, the first and every replay."""
        return self._deliveries[key]

    def reset(self) -> None:
        """Forget every record and delivery count."""
        self._records.clear()
        self._by_key.clear()
        self._deliveries.clear()

    async def _post_effect(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:  # not JSON, or not UTF-8
            return web.json_response({"error": "body must be JSON"}, status=400)
        # No await from here on: the check and the insert are atomic on the event loop, so two
        # concurrent requests with one key cannot both be recorded.
        key = request.headers.get(KEY_HEADER) or None
        if key is not None:
            self._deliveries[key] += 1
            existing = self._by_key.get(key)
            if existing is not None:
                return web.json_response({"id": existing.id, "replayed": True}, status=200)
        record = LedgerRecord(
            id=f"led_{uuid.uuid4().hex[:16]}",
            key=key,
            body=body,
            received_at=datetime.now(UTC).isoformat(),
        )
        self._records.append(record)
        if key is not None:
            self._by_key[key] = record
        self.recorded.set()
        await self.respond.wait()
        return web.json_response({"id": record.id, "replayed": False}, status=201)

    async def _get_effects(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "records": [asdict(record) for record in self._records],
                "deliveries": dict(self._deliveries),
            }
        )

    async def _post_reset(self, request: web.Request) -> web.Response:
        self.reset()
        return web.json_response({"ok": True})


async def serve(host: str, port: int) -> None:
    """Serve until SIGTERM or SIGINT, announcing the address on stdout."""
    ledger = Ledger(host, port)
    await ledger.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    # One parseable line: callers that start this as a subprocess read the port from it.
    sys.stdout.write(f"ledger listening {ledger.base_url}\n")
    sys.stdout.flush()
    try:
        await stop.wait()
    finally:
        await ledger.stop()


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m tether.testing.ledger [--host H] [--port P]`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
