"""What the local MCP server keeps across sessions and restarts, as a real server's database
would: its orders, the results stored per idempotency key, and what a test reads back (how
many times each tool really ran, per tool and per key; replays; `notifications/cancelled`
seen; handshakes and `tools/list` requests)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class StoredResult:
    """A call's answer kept under its idempotency key: text, and whether it was a tool error."""

    tool: str
    text: str
    error: bool


def _orders() -> dict[str, dict[str, str]]:
    return {
        "A-1001": {"status": "shipped", "total": "42.00"},
        "A-1002": {"status": "processing", "total": "17.50"},
    }


@dataclass
class McpLedger:
    """`executions[tool]` counts real runs (a replay is not one); `executions_by_key[key]` the
    runs under one idempotency key; `replays[key]` the answers served from the store;
    `post_connections` the client addresses (host, port) MCP POSTs came in on: one per TCP
    connection a client opened for its requests."""

    orders: dict[str, dict[str, str]] = field(default_factory=_orders)
    executions: dict[str, int] = field(default_factory=dict)
    executions_by_key: dict[str, int] = field(default_factory=dict)
    replays: dict[str, int] = field(default_factory=dict)
    results: dict[str, StoredResult] = field(default_factory=dict)
    emails: list[tuple[str, str]] = field(default_factory=list)
    cancel_notifications: list[Any] = field(default_factory=list)
    initializations: int = 0
    listings: int = 0
    slow_started: int = 0
    slow_interrupted: int = 0
    post_connections: set[tuple[str, int]] = field(default_factory=set)
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict, repr=False)

    def lock(self, key: str) -> asyncio.Lock:
        """The lock calls under `key` take, so a second one waits for the first's answer."""
        return self._locks.setdefault(key, asyncio.Lock())

    def executed(self, tool: str, key: str | None) -> None:
        """Count one real run of `tool` (under `key` when it had one)."""
        self.executions[tool] = self.executions.get(tool, 0) + 1
        if key is not None:
            self.executions_by_key[key] = self.executions_by_key.get(key, 0) + 1

    def store(self, key: str, tool: str, text: str, *, error: bool) -> None:
        """Keep the answer given under `key`."""
        self.results[key] = StoredResult(tool, text, error)

    def to_json(self) -> dict[str, Any]:
        """What `GET /_state` answers."""
        return {
            "orders": self.orders,
            "executions": self.executions,
            "executions_by_key": self.executions_by_key,
            "replays": self.replays,
            "emails": [list(e) for e in self.emails],
            "cancel_notifications": self.cancel_notifications,
            "initializations": self.initializations,
            "listings": self.listings,
            "slow_started": self.slow_started,
            "slow_interrupted": self.slow_interrupted,
            "post_connections": len(self.post_connections),
        }
