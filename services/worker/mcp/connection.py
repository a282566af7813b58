"""One MCP session with one server, over the SDK's streamable-HTTP client, held open by a task.

The SDK's transport and session are anyio context managers that must be entered and left in one
task, and a transport failure tears its task group down: so a holder task owns them, calls run
in tasks of their own and watch the holder, and a transport that dies fails the calls in flight
with its reason instead of cancelling whoever was waiting. What the HTTP layer saw that the SDK's
errors leave out (a 404 answered to our session id, a 401's challenge, a 5xx) is recorded by a
response hook and read back when a call fails."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx2
from mcp import ClientSession
from mcp.client.streamable_http import MCP_SESSION_ID, streamable_http_client
from mcp.types import Implementation

from services.worker.mcp.reuse import ReusingTransport
from tether.mcp_wire import IDEMPOTENCY_KEY_META

CLIENT_INFO = Implementation(name="tether-worker", version="1")
MAX_REMEMBERED = 4096


@dataclass(frozen=True, slots=True)
class Seen:
    """One notable HTTP answer: its status, whether our request carried a session id, and
    the `WWW-Authenticate` challenge if any."""

    seq: int
    status: int
    had_session: bool
    challenge: str


class Observer:
    """The notable answers (401, 403, 404, 5xx) of one connection, numbered, and the
    idempotency keys of the `tools/call` requests the server answered at all (so a call whose
    request failed to connect is known not to have reached it)."""

    def __init__(self) -> None:
        self._seq = itertools.count(1)
        self._last = 0
        self.seen: list[Seen] = []
        self.reached: set[str] = set()

    def mark(self) -> int:
        """The number of the last answer seen so far: what came after it is a call's."""
        return self._last

    def since(self, mark: int) -> list[Seen]:
        """The notable answers after `mark`."""
        return [s for s in self.seen if s.seq > mark]

    async def on_response(self, response: httpx2.Response) -> None:
        """The HTTP client's response hook."""
        self._last = next(self._seq)
        key = _call_key(response.request)
        if key is not None:
            if len(self.reached) >= MAX_REMEMBERED:
                self.reached.clear()  # the key asked about is a call's just sent, never an old one
            self.reached.add(key)
        status = response.status_code
        if status in (401, 403, 404) or status >= 500:
            self.seen.append(
                Seen(
                    self._last,
                    status,
                    MCP_SESSION_ID in response.request.headers,
                    response.headers.get("www-authenticate", ""),
                )
            )
            del self.seen[:-32]  # the recent ones are all a failing call reads


class Connection:
    """A session with `url` (as `token`'s bearer when given), open once `open()` returns."""

    def __init__(self, url: str, token: str | None, timeout_s: float) -> None:
        self.url = url
        self.token = token
        self.observer = Observer()
        self.error: BaseException | None = None
        self._timeout_s = timeout_s
        self._session: ClientSession | None = None
        self._ready = asyncio.Event()
        self._closing = asyncio.Event()
        self._holder: asyncio.Task[None] | None = None
        self.busy = 0

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """While a request is in flight on this session (it is not closed as idle then)."""
        self.busy += 1
        try:
            yield
        finally:
            self.busy -= 1

    @property
    def session(self) -> ClientSession:
        """The initialised session (only after `open()` returned)."""
        assert self._session is not None
        return self._session

    @property
    def holder(self) -> asyncio.Task[None]:
        """The task holding the session: done means the session is gone."""
        assert self._holder is not None
        return self._holder

    @property
    def alive(self) -> bool:
        """Whether calls may still go through this session."""
        return self._holder is not None and not self._holder.done() and self._ready.is_set()

    async def open(self) -> None:
        """Connect and initialise; on failure the reason is `error` (re-raised as is)."""
        self._holder = asyncio.create_task(self._hold(), name=f"mcp session {self.url}")
        ready = asyncio.create_task(self._ready.wait())
        try:
            await asyncio.wait(
                {ready, self._holder},
                timeout=self._timeout_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
        except asyncio.CancelledError:
            # The caller gave up while the session opened: no session is left behind.
            self._closing.set()
            self._holder.cancel()
            raise
        finally:
            ready.cancel()
        if self._ready.is_set():
            return
        if not self._holder.done():
            self.error = TimeoutError(f"no answer to initialize within {self._timeout_s:g}s")
        await self.close()
        raise self.error or RuntimeError("the MCP session ended while it was being opened")

    async def ended(self, within_s: float) -> BaseException | None:
        """The transport's reason once its holder has ended (waiting up to `within_s` for a
        teardown under way), or None when it is still running."""
        if self._holder is None:
            return self.error
        await asyncio.wait({self._holder}, timeout=within_s)
        return self.error if self._holder.done() else None

    async def close(self) -> None:
        """End the session (a DELETE tells the server when it is still reachable)."""
        self._closing.set()
        if self._holder is None:
            return
        if not self._ready.is_set():
            self._holder.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._holder

    async def _hold(self) -> None:
        headers = {"authorization": f"Bearer {self.token}"} if self.token else None
        timeout = httpx2.Timeout(self._timeout_s, read=300.0)
        try:
            async with (
                httpx2.AsyncClient(
                    transport=ReusingTransport(),
                    headers=headers,
                    timeout=timeout,
                    event_hooks={"response": [self.observer.on_response]},
                ) as http,
                streamable_http_client(self.url, http_client=http) as (read, write),
                # Every request is bounded: a call by its own timeout, a listing by this one.
                ClientSession(
                    read, write, read_timeout_seconds=self._timeout_s, client_info=CLIENT_INFO
                ) as session,
            ):
                await session.initialize()
                self._session = session
                self._ready.set()
                await self._closing.wait()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the transport's reason, read by whoever waits on us
            self.error = root_cause(exc)


def _call_key(request: httpx2.Request) -> str | None:
    """The idempotency key of a `tools/call` POST, None for any other request."""
    if request.method != "POST" or b'"tools/call"' not in request.content:
        return None
    try:
        key = json.loads(request.content)["params"]["_meta"][IDEMPOTENCY_KEY_META]
    except (ValueError, KeyError, TypeError):
        return None
    return key if isinstance(key, str) else None


def root_cause(exc: BaseException) -> BaseException:
    """The first leaf of an exception group that is not a cancellation (the SDK's task groups
    wrap a transport's failure in one or two groups)."""
    if isinstance(exc, BaseExceptionGroup):
        leaves = [root_cause(e) for e in exc.exceptions]
        real = [e for e in leaves if not isinstance(e, asyncio.CancelledError)]
        return (real or leaves)[0]
    return exc
