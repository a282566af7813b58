"""The worker's MCP client: one session per server (and credential) per worker process, opened
lazily; tool listings cached per server for a short time; calls that carry the idempotency key
in `_meta` and come back as an `McpOutcome`, never an exception.

Sessions survive what breaks them in the field. A request answered `404` for our session id
means the server no longer knows the session (it restarted, or expired it): as the specification
requires, the client starts a new session with a fresh `initialize` and retries the request once
(the server refused it unseen, so the retry cannot run it twice). A transport that died (the
server went down) is replaced at the next call. A cancelled call is abandoned by the SDK, which
sends `notifications/cancelled` for it."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import httpx2
import mcp.types as mcp_types

from services.worker.mcp.catalog import ListedTool, Offer, merge, server_offer
from services.worker.mcp.classify import (
    CONNECT_FAILURES,
    classify,
    connection_closed,
    expired_session,
)
from services.worker.mcp.connection import Connection, root_cause
from services.worker.mcp.oauth import discover
from services.worker.mcp.outcome import McpFailure, McpOutcome, failed, from_result
from tether.domain import McpServer
from tether.errors import InvalidArgument
from tether.mcp_wire import IDEMPOTENCY_KEY_META
from tether.targets import TargetPolicy, check_url

DEFAULT_LIST_TTL_S = 30.0
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_CALL_TIMEOUT_S = 30.0
DEFAULT_MAX_SESSIONS = 64
"""Sessions kept open at once (one per server and credential: with OAuth, per principal); the
least recently used idle one is closed past it, and opened again when next needed."""
MAX_LIST_PAGES = 20

_Key = tuple[str, str, str]
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Listing:
    """A server's tools as listed (`tools`), or why they could not be (`failure`)."""

    tools: tuple[ListedTool, ...] = ()
    failure: McpOutcome | None = None


class McpClients:
    """Every MCP session of this worker process. `target_policy` is checked before a session is
    opened (the deployment's outbound-target rule, as at apply: DNS may have changed since)."""

    def __init__(
        self,
        *,
        target_policy: TargetPolicy | None = None,
        list_ttl_s: float = DEFAULT_LIST_TTL_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._policy = target_policy
        self._max_sessions = max_sessions
        self._ttl = list_ttl_s
        self._connect_timeout = connect_timeout_s
        self._clock = clock
        self._connections: dict[_Key, Connection] = {}
        self._locks: dict[_Key, asyncio.Lock] = {}
        self._listings: dict[_Key, tuple[float, tuple[ListedTool, ...]]] = {}
        self.round_trips = 0  # tools/list requests sent: what a warm cache saves

    # Listing ------------------------------------------------------------------------------

    async def offer(
        self,
        servers: Sequence[McpServer],
        tokens: Mapping[str, str | None] | None = None,
        taken: Iterable[str] = (),
    ) -> tuple[Offer, dict[str, McpOutcome]]:
        """What a run is offered of `servers` (in the agent's order; `tokens` by server name;
        `taken` the names the run's other tools hold), and the failure of each server that
        could not be listed (its tools are left out with a warning in the offer)."""
        tokens = tokens or {}
        listings = await asyncio.gather(*(self.list_tools(s, tokens.get(s.name)) for s in servers))
        offers: list[Offer] = []
        failures: dict[str, McpOutcome] = {}
        for server, listing in zip(servers, listings, strict=True):
            if listing.failure is not None:
                failures[server.name] = listing.failure
                warning = f"MCP server {server.name!r} is left out: {listing.failure.content}"
                offers.append(Offer((), (warning,)))
            else:
                offers.append(server_offer(server, listing.tools))
        return merge(offers, taken), failures

    async def list_tools(self, server: McpServer, token: str | None = None) -> Listing:
        """The server's tools, from the cache while it is fresh (no round trip)."""
        key = _key(server, token)
        cached = self._listings.get(key)
        if cached is not None and cached[0] > self._clock():
            return Listing(cached[1])
        for attempt in range(2):
            connection = await self._connection(server, token)
            if isinstance(connection, McpOutcome):
                return Listing(failure=connection)
            mark = connection.observer.mark()
            try:
                with connection.in_use():
                    tools = await self._whole_listing(connection)
            except Exception as exc:
                gone = connection_closed(exc) or expired_session(
                    exc, connection.observer.since(mark)
                )
                if gone:
                    await self._drop(key, connection)
                if gone and attempt == 0:
                    continue  # a listing reads only: asking again is harmless
                return Listing(failure=await self._failure(connection, exc, mark, definite=True))
            self._listings[key] = (self._clock() + self._ttl, tools)
            return Listing(tools)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _whole_listing(self, connection: Connection) -> tuple[ListedTool, ...]:
        tools: list[ListedTool] = []
        cursor: str | None = None
        for _ in range(MAX_LIST_PAGES):
            self.round_trips += 1
            params = mcp_types.PaginatedRequestParams(cursor=cursor) if cursor else None
            page = await _or_holder(connection, connection.session.list_tools(params=params))
            tools.extend(_listed(t) for t in page.tools)
            cursor = page.next_cursor
            if not cursor:
                break
        return tuple(tools)

    # Calling ------------------------------------------------------------------------------

    async def call(
        self,
        server: McpServer,
        tool: str,
        input: Mapping[str, Any],
        idempotency_key: str,
        cancellation: asyncio.Event | None = None,
        *,
        token: str | None = None,
        timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
    ) -> McpOutcome:
        """Call `tool` (the server's name for it) with `input`, the key in `_meta`. Setting
        `cancellation` stops the call (the server is sent notifications/cancelled) and answers
        CANCELLED; cancelling the calling task does the same and propagates."""
        key = _key(server, token)
        # `_meta` is an open map; the TypedDict names only the protocol's own keys.
        meta = cast("mcp_types.RequestParamsMeta", {IDEMPOTENCY_KEY_META: idempotency_key})
        for attempt in range(2):
            connection = await self._connection(server, token)
            if isinstance(connection, McpOutcome):
                return connection
            mark = connection.observer.mark()
            request = connection.session.call_tool(
                tool, dict(input), read_timeout_seconds=timeout_s, meta=meta
            )
            try:
                with connection.in_use():
                    result = await _or_holder(connection, request, cancellation)
            except _Cancelled:
                return failed(
                    McpFailure.CANCELLED,
                    f"the call to {tool!r} was cancelled before the server answered; it may "
                    "have run in part",
                    definite=False,
                )
            except Exception as raised:
                exc: BaseException = raised
                expired = expired_session(exc, connection.observer.since(mark))
                unsent = False
                if connection_closed(exc):
                    # The transport closed under the call: its reason says whether the request
                    # ever connected (the holder is tearing down; it ends promptly).
                    reason = await connection.ended(within_s=self._connect_timeout)
                    unsent = isinstance(reason, CONNECT_FAILURES) and (
                        idempotency_key not in connection.observer.reached
                    )
                    exc = reason if unsent and reason is not None else exc
                if expired or connection_closed(exc) or unsent:
                    await self._drop(key, connection)
                if attempt == 0 and (expired or unsent):
                    # The server refused it unseen (404), or it never connected: a new session
                    # may send it once more without running it twice.
                    continue
                return await self._failure(connection, exc, mark, definite=unsent)
            return from_result(result)
        raise AssertionError("unreachable")  # pragma: no cover

    async def aclose(self) -> None:
        """End every session."""
        connections, self._connections = list(self._connections.values()), {}
        await asyncio.gather(*(c.close() for c in connections), return_exceptions=True)

    # Sessions -----------------------------------------------------------------------------

    async def _connection(self, server: McpServer, token: str | None) -> Connection | McpOutcome:
        """The live session for `server` as `token`, opened when there is none."""
        key = _key(server, token)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            current = self._connections.get(key)
            if current is not None and current.alive:
                self._connections[key] = self._connections.pop(key)  # the most recently used
                return current
            if current is not None:
                self._connections.pop(key, None)
                await current.close()
            if self._policy is not None:
                try:
                    await check_url(server.url, self._policy, what=f"MCP server {server.name!r}")
                except InvalidArgument as exc:
                    return failed(McpFailure.REFUSED_TARGET, exc.message, definite=True)
            connection = Connection(server.url, token, self._connect_timeout)
            mark = connection.observer.mark()
            try:
                await connection.open()
            except Exception as exc:
                # Nothing of the call was sent: whatever failed, failed before it.
                return await self._failure(connection, exc, mark, definite=True)
            self._connections[key] = connection
            await self._evict()
            return connection

    async def _evict(self) -> None:
        """Close the least recently used idle sessions past `max_sessions`."""
        idle = [k for k, c in self._connections.items() if not c.busy]
        for key in idle[: max(0, len(self._connections) - self._max_sessions)]:
            connection = self._connections.pop(key)
            self._listings.pop(key, None)
            await connection.close()

    async def _drop(self, key: _Key, connection: Connection) -> None:
        if self._connections.get(key) is connection:
            del self._connections[key]
        self._listings.pop(key, None)
        await connection.close()

    async def _failure(
        self, connection: Connection, exc: BaseException, mark: int, *, definite: bool
    ) -> McpOutcome:
        seen = connection.observer.since(mark)
        outcome = classify(root_cause(exc), seen, definite=definite)
        if outcome.failure is McpFailure.UNAUTHORISED:
            denial = next(s for s in reversed(seen) if s.status in (401, 403))
            async with httpx2.AsyncClient(timeout=self._connect_timeout) as http:
                challenge = await discover(
                    http,
                    connection.url,
                    denial.status,
                    denial.challenge,
                    token_sent=connection.token is not None,
                    allowed=self._allowed,
                )
            return failed(
                McpFailure.UNAUTHORISED,
                outcome.content,
                definite=True,
                challenge=challenge,
                detail=outcome.detail,
            )
        return outcome

    async def _allowed(self, url: str) -> bool:
        if self._policy is None:
            return True
        try:
            await check_url(url, self._policy, what="OAuth metadata URL")
        except InvalidArgument:
            return False
        return True


class _Cancelled(Exception):
    """The caller's cancellation was set."""


async def _or_holder(
    connection: Connection, request: Awaitable[T], cancellation: asyncio.Event | None = None
) -> T:
    """`request`'s result, or the reason the session's transport died under it, or _Cancelled."""
    task = asyncio.ensure_future(request)
    cancel_wait = asyncio.ensure_future(cancellation.wait()) if cancellation else None
    waits: set[asyncio.Future[Any]] = {task, connection.holder}
    if cancel_wait is not None:
        waits.add(cancel_wait)
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()  # the SDK sends notifications/cancelled as it unwinds
        await asyncio.gather(task, return_exceptions=True)
        raise
    finally:
        if cancel_wait is not None:
            cancel_wait.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    if cancel_wait is not None and cancellation is not None and cancellation.is_set():
        raise _Cancelled
    raise connection.error or ConnectionError("the MCP session ended")


def _key(server: McpServer, token: str | None) -> _Key:
    # A digest, so a token is not kept as a dictionary key (or shown in a repr of one).
    credential = hashlib.sha256(token.encode()).hexdigest() if token else ""
    return (server.name, server.url, credential)


def _listed(tool: mcp_types.Tool) -> ListedTool:
    annotations = (
        tool.annotations.model_dump(by_alias=True, exclude_none=True) if tool.annotations else {}
    )
    return ListedTool(tool.name, tool.description or "", tool.input_schema, annotations)
