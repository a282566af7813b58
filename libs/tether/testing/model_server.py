"""A local Anthropic-compatible server: `POST /v1/messages` as the real API speaks it.

Point the real SDK at it (`AsyncAnthropic(base_url=server.base_url, api_key="test")`) and
script what it answers per test; with nothing scripted it runs the demo agent. In process::

    async with ModelServer() as server:
        server.script("say hi", [ErrorTurn(529), TextTurn("hi")])
        ...  # the first request whose first user text is "say hi" gets a 529, the next "hi"
        assert [r.headers["x-stainless-retry-count"] for r in server.requests] == ["0", "1"]

Out of process: `python -m tether.testing.model_server --port 0` prints
`model-server listening http://HOST:PORT`; script it with `POST /_script`
(`{"key": ..., "turns": [...]}`, format in `model_script.turn_from_json`), read the request log
with `GET /_requests`, clear both with `POST /_reset`. `limits=RateLimits(...)` (or
`--rate-limit requests=N,input_tokens=N,output_tokens=N,window=SECONDS`) enforces the provider's
rate limits per API key; see model_limits.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from aiohttp import web

from tether.testing.demo_agent import demo_turn
from tether.testing.local_server import LocalServer, run_cli
from tether.testing.model_cache import CacheRequestError, PromptCache
from tether.testing.model_limits import ModelRateLimiter, RateLimits
from tether.testing.model_log import (
    LOGGED_HEADERS,
    RecordedRequest,
    abort_connection,
    auth_scheme,
    error_response,
    scripted_error,
)
from tether.testing.model_script import (
    DEFAULT_KEY,
    KEY_HEADER,
    BlocksTurn,
    Cut,
    ErrorTurn,
    Fault,
    MidStreamError,
    ScriptBook,
    ScriptFormatError,
    Stall,
    TextBlock,
    TextTurn,
    ThinkingBlock,
    ToolUseBlock,
    ToolUseTurn,
    Truncated,
    Turn,
    Usage,
    as_message_turn,
    script_key,
    turn_from_json,
)
from tether.testing.model_wire import (
    STATUS_BY_ERROR_TYPE,
    RenderedTurn,
    error_body,
    frame,
    input_tokens_for,
    message_json,
    new_request_id,
    request_problem,
    resolve_turn,
    stream_events,
)

__all__ = [
    "DEFAULT_KEY",
    "KEY_HEADER",
    "BlocksTurn",
    "Cut",
    "ErrorTurn",
    "MidStreamError",
    "ModelServer",
    "RateLimits",
    "RecordedRequest",
    "Stall",
    "TextBlock",
    "TextTurn",
    "ThinkingBlock",
    "ToolUseBlock",
    "ToolUseTurn",
    "Truncated",
    "Turn",
    "Usage",
    "main",
]

MAX_BODY_BYTES = 32 * 1024 * 1024
"""The real Messages API accepts request bodies up to 32 MB."""


class ModelServer(LocalServer):
    """The server. `start()` binds (port 0 picks a free one); `stop()` ends every response.

    Scripted turns and the request log live on the event loop that called `start()`.
    """

    name = "model-server"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        shutdown_grace: float = 1.0,
        access_log: bool = False,
        cache_clock: Callable[[], float] = time.monotonic,
        limits: RateLimits | None = None,
    ) -> None:
        super().__init__(host, port)
        # Rate limits per API key as the provider enforces them (model_limits); off when None.
        self.limiter = None if limits is None else ModelRateLimiter(limits)
        # The prompt cache, as the real API keeps it (see model_cache): usage reports its hits.
        self.cache = PromptCache(cache_clock)
        self._shutdown_grace = shutdown_grace
        self._access_log = access_log
        self._book = ScriptBook()
        self._requests: list[RecordedRequest] = []
        self._changed = asyncio.Event()
        self._closing = asyncio.Event()

    # Lifecycle -------------------------------------------------------------------------------

    def runner_options(self) -> dict[str, Any]:
        """Handler cancellation: a client that disconnects cancels its handler, which is how a
        stall "until the client goes away" ends and how `outcome="disconnected"` is observed."""
        return {
            "handler_cancellation": True,
            "access_log": logging.getLogger("aiohttp.access") if self._access_log else None,
            "shutdown_timeout": self._shutdown_grace,
        }

    async def start(self) -> None:
        """Bind and begin serving."""
        self._closing.clear()
        await super().start()

    async def stop(self) -> None:
        """Stop: end stalls at once, give responses `shutdown_grace` seconds, then cancel them."""
        self._closing.set()
        await super().stop()

    # Scripting -------------------------------------------------------------------------------

    def script(self, key: str | None, turns: Iterable[Turn]) -> int:
        """Queue turns for requests that select `key` (None: the default queue); returns its length.

        A turn is taken by exactly one request, so an SDK retry takes the next one.
        """
        return self._book.add(key, turns)

    def pending(self, key: str | None = None) -> int:
        """Turns still queued under `key`."""
        return self._book.pending(key)

    def drop_script(self, key: str | None) -> int:
        """Forget the turns still queued under `key` (a conversation's leftovers); returns how
        many there were."""
        return self._book.drop(key)

    def reset(self) -> None:
        """Forget every scripted turn, the request log and the prompt cache."""
        self._book.clear()
        self._requests.clear()
        self.cache.clear()
        if self.limiter is not None:
            self.limiter.clear()

    @property
    def requests(self) -> list[RecordedRequest]:
        """A copy of the request log, oldest first."""
        return list(self._requests)

    async def wait_until(self, predicate: Callable[[Sequence[RecordedRequest]], bool]) -> None:
        """Wait until `predicate(log)` holds; re-checked on every new request or outcome.

        Has no timeout of its own: wrap it in `asyncio.timeout(...)`.
        """
        while not predicate(self._requests):
            await self._changed.wait()

    async def wait_for_requests(self, count: int) -> list[RecordedRequest]:
        """Wait until at least `count` requests have arrived; returns the log."""
        await self.wait_until(lambda log: len(log) >= count)
        return self.requests

    def _notify(self) -> None:
        # Synchronous on purpose: a handler being cancelled must still be able to report.
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # The app ---------------------------------------------------------------------------------

    def build_app(self) -> web.Application:
        """The aiohttp application (exposed for embedding in another app or runner)."""
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        if self.limiter is not None:
            app.on_response_prepare.append(self.limiter.on_prepare)
        app.router.add_post("/v1/messages", self._messages)
        app.router.add_post("/v1/messages/count_tokens", self._count_tokens)
        app.router.add_post("/_script", self._control_script)
        app.router.add_get("/_requests", self._control_requests)
        app.router.add_post("/_reset", self._control_reset)
        app.router.add_get("/_health", self._control_health)
        app.router.add_route("*", "/{tail:.*}", self._not_found)
        return app

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        request_id = new_request_id()
        raw = await request.read()
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = None
        record = RecordedRequest(
            method=request.method,
            path=request.path,
            headers={
                name: request.headers[name] for name in LOGGED_HEADERS if name in request.headers
            },
            auth=auth_scheme(request),
            body=body if body is not None else raw.decode("utf-8", "replace"),
            timestamp=time.time(),
            script_key=script_key(request.headers, body) if isinstance(body, dict) else DEFAULT_KEY,
            request_id=request_id,
            stream=isinstance(body, dict) and body.get("stream") is True,
        )
        self._requests.append(record)
        self._notify()
        try:
            return await self._answer(request, record, body)
        except asyncio.CancelledError:
            # The client disconnected (handler cancellation) or the server is stopping; a
            # scripted cut also lands here, having already recorded its outcome.
            if record.outcome == "pending":
                record.outcome = "server_stopped" if self._closing.is_set() else "disconnected"
            raise
        except ConnectionResetError:
            # A write raced the disconnect. aiohttp ignores connection errors while finishing a
            # response, so handing it a placeholder keeps its error log quiet.
            if record.outcome == "pending":
                record.outcome = "disconnected"
            return web.Response(status=499)
        finally:
            if self.limiter is not None:
                self.limiter.settle(request, record)
            self._notify()

    async def _answer(
        self, request: web.Request, record: RecordedRequest, body: Any
    ) -> web.StreamResponse:
        rid = record.request_id
        if record.auth is None:
            record.served = "auth_error"
            return error_response(
                401, "authentication_error", "x-api-key header is required", rid, record
            )
        if "anthropic-version" not in request.headers:
            record.served = "invalid_request"
            return error_response(
                400, "invalid_request_error", "anthropic-version: header is required", rid, record
            )
        problem = request_problem(body)
        if problem is not None:
            record.served = "invalid_request"
            return error_response(400, "invalid_request_error", problem, rid, record)
        refused = None if self.limiter is None else self.limiter.admit(request, record, body)
        if refused is not None:
            return refused  # 429 rate_limit_error, retry-after and the anthropic-ratelimit-*

        scripted = self._book.take(record.script_key)
        record.served = "script" if scripted is not None else "demo"
        turn = scripted if scripted is not None else demo_turn(body)
        if isinstance(turn, ErrorTurn):
            return scripted_error(turn, rid, record)  # refused before the prompt was read
        try:
            accounting = self.cache.account(body)
        except CacheRequestError as exc:
            record.served = "invalid_request"
            return error_response(400, "invalid_request_error", str(exc), rid, record)
        try:
            rendered = resolve_turn(
                as_message_turn(turn), body, _tool_id_seed(body), cache=accounting
            )
            record.usage = {
                "input_tokens": rendered.usage.input_tokens,
                "cache_creation_input_tokens": rendered.usage.cache_creation_input_tokens,
                "cache_read_input_tokens": rendered.usage.cache_read_input_tokens,
                "output_tokens": rendered.usage.output_tokens,
            }
            events = stream_events(rendered)
        except ValueError as exc:
            # A broken script is the test's bug: say so in the response rather than a bare 500.
            record.served = "script_error"
            return error_response(500, "api_error", f"invalid scripted turn: {exc}", rid, record)
        if record.stream:
            return await self._stream(request, record, rendered, events)
        return await self._whole(request, record, rendered)

    async def _stream(
        self,
        request: web.Request,
        record: RecordedRequest,
        rendered: RenderedTurn,
        events: Sequence[tuple[str, dict[str, Any]]],
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            status=200, headers={"request-id": record.request_id, "cache-control": "no-cache"}
        )
        response.content_type = "text/event-stream"
        response.charset = "utf-8"
        # Chunked framing is what lets a cut be seen as an incomplete body rather than an end.
        response.enable_chunked_encoding()
        await response.prepare(request)
        fault = rendered.turn.fault
        fault_at = -1 if fault is None else max(0, min(fault.after_events, len(events)))
        delay = rendered.turn.delay_ms / 1000
        if fault is None and delay <= 0:
            # Answering at once: every event in one chunk, as a proxy that buffers would send it.
            await response.write(b"".join(frame(name, data) for name, data in events))
            await response.write_eof()
            record.outcome = "ok"
            return response
        for sent in range(len(events) + 1):
            if fault is not None and sent == fault_at:
                finished = await self._inject(request, response, record, fault)
                if finished:
                    return response
            if sent == len(events):
                break
            name, data = events[sent]
            if delay > 0 and name == "content_block_delta":
                await asyncio.sleep(delay)
            await response.write(frame(name, data))
        await response.write_eof()
        record.outcome = "ok"
        return response

    async def _inject(
        self,
        request: web.Request,
        response: web.StreamResponse,
        record: RecordedRequest,
        fault: Fault,
    ) -> bool:
        """Apply a fault to a started stream; True when the response is finished."""
        if isinstance(fault, MidStreamError):
            error = {"type": "error", "error": {"type": fault.error_type, "message": fault.message}}
            await response.write(frame("error", error))
            record.outcome = "mid_stream_error"
            await response.write_eof()
            return True
        if isinstance(fault, Truncated):
            record.outcome = "truncated"
            await response.write_eof()
            return True
        if isinstance(fault, Cut):
            record.outcome = "cut"
            abort_connection(request)
            return True
        if await self._stall(fault):
            return False
        record.outcome = "server_stopped"
        abort_connection(request)
        return True

    async def _stall(self, stall: Stall) -> bool:
        """Wait out a stall; False when the server began stopping first."""
        try:
            async with asyncio.timeout(stall.seconds):
                await self._closing.wait()
        except TimeoutError:
            return True
        return False

    async def _whole(
        self, request: web.Request, record: RecordedRequest, rendered: RenderedTurn
    ) -> web.StreamResponse:
        """A non-streaming answer. Faults map to their nearest non-streaming equivalent."""
        fault = rendered.turn.fault
        if isinstance(fault, MidStreamError):
            status = STATUS_BY_ERROR_TYPE.get(fault.error_type, 500)
            return error_response(
                status, fault.error_type, fault.message, record.request_id, record
            )
        if isinstance(fault, Cut | Truncated):
            # Without a stream there is nothing to truncate: the connection drops instead.
            record.outcome = "cut"
            abort_connection(request)
            return web.Response(status=499)
        if isinstance(fault, Stall) and not await self._stall(fault):
            record.outcome = "server_stopped"
            abort_connection(request)
            return web.Response(status=499)
        record.outcome = "ok"
        return web.json_response(message_json(rendered), headers={"request-id": record.request_id})

    async def _count_tokens(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            rid = new_request_id()
            problem = error_body("invalid_request_error", "request body must be a JSON object", rid)
            return web.json_response(problem, status=400, headers={"request-id": rid})
        return web.json_response({"input_tokens": input_tokens_for(body)})

    async def _control_script(self, request: web.Request) -> web.StreamResponse:
        try:
            payload = await request.json()
            key = payload.get("key")
            turns = [turn_from_json(raw) for raw in payload["turns"]]
        except (ValueError, KeyError, TypeError, AttributeError, ScriptFormatError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        pending = self.script(None if key is None else str(key), turns)
        return web.json_response(
            {"key": key or DEFAULT_KEY, "queued": len(turns), "pending": pending}
        )

    async def _control_requests(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"requests": [r.to_json() for r in self._requests]})

    async def _control_reset(self, request: web.Request) -> web.StreamResponse:
        self.reset()
        return web.json_response({"ok": True})

    async def _control_health(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"ok": True})

    async def _not_found(self, request: web.Request) -> web.StreamResponse:
        rid = new_request_id()
        body = error_body("not_found_error", f"Not found: {request.method} {request.path}", rid)
        return web.json_response(body, status=404, headers={"request-id": rid})


def _tool_id_seed(body: Any) -> str:
    """Tool ids derive from the conversation so a replayed request gets the same ids."""
    digest = hashlib.sha256(json.dumps(body.get("messages"), sort_keys=True).encode())
    return digest.hexdigest()[:20]


# Command line ---------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m tether.testing.model_server [--host H] [--port P] [--access-log]`."""

    def make(args: argparse.Namespace) -> ModelServer:
        if args.access_log:
            logging.basicConfig(level=logging.INFO, stream=sys.stderr)
        limits = None if not args.rate_limit else RateLimits.parse(args.rate_limit)
        return ModelServer(args.host, args.port, access_log=args.access_log, limits=limits)

    def extra(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--access-log", action="store_true", help="log each request")
        parser.add_argument(
            "--rate-limit",
            default="",
            help="limits per API key, e.g. requests=50,input_tokens=40000,output_tokens=8000,"
            "window=60 (seconds); off when absent",
        )

    run_cli(__doc__, make, argv, extra=extra)


if __name__ == "__main__":
    main()
