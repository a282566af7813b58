"""What both versions of the HTTP bridge share: the call context handed to the servicer, the
body and query readers, opening a run's or a conversation's stream from a request, and serving
an async stream of items as server-sent events."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, Callable, Mapping
from contextlib import aclosing
from typing import Any, TypeVar

from aiohttp import web
from google.protobuf import json_format
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

from services.gateway.auth import TENANT_METADATA, KeyWatch
from services.gateway.http.errors import error_body
from services.gateway.live.conversation import ConversationCursor, conversation_items
from services.gateway.live.streams import Streams
from tether.errors import InvalidArgument, TetherError
from tether.limits import INT64_MAX, check_request
from tether.v1 import gateway_pb2
from tether.visibility import Viewer

log = logging.getLogger(__name__)
T = TypeVar("T")
M = TypeVar("M", bound=Message)

# EventSource waits this long before reconnecting after the stream ends or breaks.
SSE_RETRY_MS = 1000


class CallContext:
    """What the servicer's unary methods read from a gRPC context: the caller's metadata.
    `authorization` is the credential as the route resolved it (v1: the header)."""

    def __init__(self, request: web.Request, authorization: str | None = None) -> None:
        self._metadata = (
            (
                "authorization",
                authorization_header(request) if authorization is None else authorization,
            ),
            (TENANT_METADATA, header(request, "Tether-Tenant")),
        )

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        """An HTTP request has no deadline."""
        return None

    def metadata(self) -> dict[str, str]:
        """The metadata as a mapping (for a stream's key watch)."""
        return dict(self._metadata)


async def read_body(request: web.Request, into: M) -> M:
    """The JSON object of the body parsed into `into` (an empty body leaves it empty)."""
    raw = await request.read()
    if not raw.strip():
        return into
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InvalidArgument("the request body is not valid UTF-8") from exc
    except (ValueError, RecursionError) as exc:
        raise InvalidArgument(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidArgument(f"the request body must be a JSON object, not {type(data).__name__}")
    try:
        json_format.ParseDict(data, into)
    except (json_format.ParseError, ValueError, TypeError, RecursionError) as exc:
        raise InvalidArgument(f"request body: {exc}") from exc
    return into


def header(request: web.Request, name: str) -> str:
    """A header's value; aiohttp keeps bytes that are not UTF-8 as lone surrogates."""
    value = request.headers.get(name, "")
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"the {name} header is not valid UTF-8") from exc
    return value


def authorization_header(request: web.Request) -> str:
    """The Authorization header's value, "" when absent, empty or blank: such a header is no
    credential, so it must not count as one (it would skip the CSRF check of the cookie that
    then signs the request in)."""
    return header(request, "Authorization").strip()


def non_negative(value: str, name: str, maximum: int) -> int:
    """A query or header integer: ASCII digits only (int() also takes "+1", "1_0", non-ASCII)."""
    if not (value.isascii() and value.isdigit()) or int(value) > maximum:
        raise InvalidArgument(f"{name} must be an integer from 0 to {maximum}; got {value[:40]!r}")
    return int(value)


def time_query(query: Mapping[str, str], name: str, into: Timestamp) -> None:
    """Set `into` from the query's RFC 3339 time `name`, when the query has it."""
    if name not in query:
        return
    try:
        into.FromJsonString(query[name])
    except ValueError as exc:
        raise InvalidArgument(
            f"{name} must be an RFC 3339 time such as 2025-01-31T09:00:00Z; got "
            f"{query[name][:40]!r}"
        ) from exc


def run_stream(
    request: web.Request,
    streams: Streams,
    viewer: Viewer,
    key_watch: KeyWatch,
    *,
    include_deltas: bool,
) -> AsyncGenerator[gateway_pb2.StreamRunResponse, None]:
    """A run's stream as an SSE request opens it: the run in the path, the cursor from
    Last-Event-ID or `?after=` (every version reads them alike)."""
    cursor = header(request, "Last-Event-ID") or request.query.get("after", "0")
    opened = gateway_pb2.StreamRunRequest(
        run_id=request.match_info["run_id"],
        after_seq=non_negative(cursor or "0", "Last-Event-ID / after", INT64_MAX),
        include_deltas=include_deltas,
    )
    check_request(opened)
    return streams.run_items(
        viewer, opened.run_id, opened.after_seq, include_deltas=include_deltas, key_watch=key_watch
    )


def conversation_stream(
    request: web.Request,
    streams: Streams,
    viewer: Viewer,
    key_watch: KeyWatch,
    *,
    include_deltas: bool,
) -> AsyncGenerator[gateway_pb2.StreamConversationResponse, None]:
    """A conversation's stream as an SSE request opens it: the conversation in the path, the
    cursor from Last-Event-ID or `?cursor=`, refused before the stream starts when malformed."""
    opened = gateway_pb2.StreamConversationRequest(
        conversation_id=request.match_info["conversation_id"],
        cursor=header(request, "Last-Event-ID") or request.query.get("cursor", ""),
        include_deltas=include_deltas,
    )
    check_request(opened)
    ConversationCursor.decode(opened.cursor)
    return conversation_items(
        streams,
        viewer,
        opened.conversation_id,
        opened.cursor,
        include_deltas=include_deltas,
        key_watch=key_watch,
    )


def sse_frame(event: str, data: dict[str, Any], event_id: str | None = None) -> bytes:
    """One server-sent event."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    body = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"{head}event: {event}\ndata: {body}\n\n".encode()


def error_frame_v1(exc: TetherError) -> bytes:
    """v1's last frame of a stream ended early: the resume cursor inside the error."""
    resume = exc.details.get("resume")
    return sse_frame("error", error_body(exc, **({"resume": resume} if resume is not None else {})))


async def serve_sse(
    request: web.Request,
    items: AsyncGenerator[T, None],
    frame: Callable[[T], bytes],
    *,
    wait_for_first: bool,
    error_frame: Callable[[TetherError], bytes] = error_frame_v1,
) -> web.StreamResponse:
    """Send `items` as server-sent events. With `wait_for_first`, a failure before the first
    item (not found, bad cursor) is still an ordinary HTTP error."""
    async with aclosing(items) as stream:
        first = [await anext(stream)] if wait_for_first else []
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",  # a proxy must not buffer a live stream
            }
        )
        await response.prepare(request)
        # The first frame also tells EventSource how soon to reconnect.
        prefix = f"retry: {SSE_RETRY_MS}\n".encode()
        try:
            for item in first:
                await response.write(prefix + frame(item))
                prefix = b""
            async for item in stream:
                await response.write(prefix + frame(item))
                prefix = b""
        except TetherError as exc:
            await response.write(error_frame(exc))
        except ConnectionResetError:
            pass  # the client went away
        except Exception:
            log.exception("stream %s failed", request.path)
            await response.write(sse_frame("error", {"error": {"status": "INTERNAL"}}))
        return response
