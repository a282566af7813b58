"""A test-only external system that records side effects and deduplicates on Idempotency-Key.

It stands in for the world a tool writes to, so tests can count what actually arrived::

    async with Ledger() as ledger:
        ...  # point publish_post at ledger.base_url (TETHER_TOOL_LEDGER_URL)
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

import asyncio
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from tether.testing.local_server import LocalServer, run_cli

KEY_HEADER = "Idempotency-Key"


@dataclass(frozen=True)
class LedgerRecord:
    """One recorded effect; `key` is None for a request that carried no Idempotency-Key."""

    id: str
    key: str | None
    body: Any
    received_at: str


class Ledger(LocalServer):
    """The server. `start()` binds (port 0 picks a free one); `stop()` closes it."""

    name = "ledger"

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(host, port)
        self._records: list[LedgerRecord] = []
        self._by_key: dict[str, LedgerRecord] = {}
        self._deliveries: Counter[str] = Counter()
        # Cleared by a test to hold responses after recording: the effect has happened but
        # the caller has not heard back (the moment a crash makes a duplicate likely).
        self.respond = asyncio.Event()
        self.respond.set()
        self.recorded = asyncio.Event()

    def build_app(self) -> web.Application:
        """The routes."""
        app = web.Application()
        app.router.add_post("/effects", self._post_effect)
        app.router.add_get("/effects", self._get_effects)
        app.router.add_post("/_reset", self._post_reset)
        return app

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


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m tether.testing.ledger [--host H] [--port P]`."""
    run_cli(__doc__, lambda args: Ledger(args.host, args.port), argv)


if __name__ == "__main__":
    main()
