"""How the HTTP bridge answers every error: `{"error": {"status", "code", "message"}}` as JSON
with the HTTP status of the gRPC code, whether the error is a TetherError from the servicer,
one of aiohttp's own refusals (no such route, body too large), or HTTP so malformed that
aiohttp's parser refuses it before any route or middleware runs."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc
from aiohttp import web
from aiohttp.http_exceptions import (
    BadHttpMessage,
    ContentEncodingError,
    HttpProcessingError,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
)
from aiohttp.web_protocol import _ErrInfo

from tether.errors import InvalidArgument, TetherError

log = logging.getLogger(__name__)

HTTP_STATUS: Mapping[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.FAILED_PRECONDITION: 412,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

# The largest JSON body (aiohttp's default): a text at its 32,000-character limit, escaped, fits.
MAX_BODY_BYTES = 1 << 20
# The longest request line and header the bridge reads (aiohttp's defaults, set here so that
# the refusal can name them).
MAX_LINE_BYTES = 8190


def error_body(exc: TetherError, **extra: Any) -> dict[str, Any]:
    """The JSON of an error."""
    return {"error": {"status": exc.status.name, "code": exc.code, "message": exc.message, **extra}}


def error_response(exc: TetherError) -> web.Response:
    """An error as the HTTP status of its gRPC code, with the same code and message."""
    headers = (
        {"WWW-Authenticate": "Bearer"} if exc.status == grpc.StatusCode.UNAUTHENTICATED else {}
    )
    return web.json_response(
        error_body(exc), status=HTTP_STATUS.get(exc.status, 500), headers=headers
    )


@web.middleware
async def errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every route's errors in the JSON shape; an unexpected one is a logged 500."""
    try:
        return await handler(request)
    except TetherError as exc:
        return error_response(exc)
    except (web.RequestPayloadError, HttpProcessingError) as exc:
        # The body broke while the route read it (bad chunking, an undecodable encoding): what
        # is left of it cannot be read, so aiohttp must not try to drain it either.
        request.content.feed_eof()
        cause = exc if isinstance(exc, HttpProcessingError) else exc.__cause__
        if not isinstance(cause, HttpProcessingError):
            cause = BadHttpMessage("the request body could not be read")
        return malformed_http_response(cause)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return http_error_response(request, exc)
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return web.json_response(
            {"error": {"status": "INTERNAL", "code": "internal", "message": "internal error"}},
            status=500,
        )


# aiohttp's own refusals (no such route, wrong method, body too large), in the same JSON shape.
_HTTP_ERRORS: Mapping[int, tuple[str, str]] = {
    404: ("NOT_FOUND", "not_found"),
    405: ("UNIMPLEMENTED", "method_not_allowed"),
    413: ("INVALID_ARGUMENT", "body_too_large"),
    417: ("INVALID_ARGUMENT", "expectation_failed"),
}


def http_error_response(request: web.BaseRequest, exc: web.HTTPException) -> web.Response:
    """One of aiohttp's HTTP errors as the bridge's JSON error."""
    status, code = _HTTP_ERRORS.get(exc.status, ("INVALID_ARGUMENT", "bad_request"))
    message = {
        404: f"no route {request.method} {request.path}; see the routes in the README",
        405: f"{request.method} is not allowed on {request.path}",
        413: f"the request body is larger than {MAX_BODY_BYTES} bytes",
        417: "the only Expect the bridge takes is 100-continue; got "
        + _printable(request.headers.get("Expect", "")),
    }.get(exc.status, exc.reason)
    return web.json_response(
        {"error": {"status": status, "code": code, "message": message}},
        status=exc.status,
        headers={k: v for k, v in exc.headers.items() if k == "Allow"},
    )


# -- malformed HTTP ---------------------------------------------------------------------------


def malformed_http_response(exc: HttpProcessingError) -> web.Response:
    """What aiohttp's parser refused, as the bridge's JSON error; the connection closes after
    it (where the next request would start is unknown)."""
    refusal = _malformed_http(exc)
    response = web.json_response(
        error_body(refusal), status=exc.code if 400 <= exc.code < 500 else 400
    )
    response.force_close()
    return response


def _malformed_http(exc: HttpProcessingError) -> InvalidArgument:
    """The caller's mistake in words they can act on; the parser's own reason where it has no
    better name (llhttp's reasons are short and plain: "Invalid character in chunk size")."""
    if isinstance(exc, LineTooLong):
        return InvalidArgument(
            f"the request line or a header is longer than {MAX_LINE_BYTES} bytes; send long "
            "values in the body",
            code="line_too_long",
        )
    if isinstance(exc, ContentEncodingError):
        return InvalidArgument(
            "the request body cannot be decoded as its Content-Encoding says; send it "
            "unencoded, or as gzip or deflate",
            code="bad_content_encoding",
        )
    if isinstance(exc, InvalidHeader):
        reason = "a header has a character HTTP does not allow there (a control character or NUL)"
    elif isinstance(exc, InvalidURLError):
        reason = f"its target is not a valid URL ({_parser_reason(exc)})"
    else:
        reason = _parser_reason(exc)
    return InvalidArgument(f"the request is not valid HTTP: {reason}", code="malformed_http")


# Where the parser's message goes on to quote the request's bytes (which may be anything).
_QUOTED = ("b'", 'b"', "bytearray(", "^")
# The parser's reason is a line or two; past this it is quoting what the caller sent.
_REASON_CHARS = 120


def _parser_reason(exc: HttpProcessingError) -> str:
    """The parser's reason without the request bytes it quotes."""
    words = []
    for line in exc.message.splitlines():
        line = line.strip()
        if line.startswith(_QUOTED):
            break
        if line:
            words.append(line.rstrip(":"))
    return _printable(": ".join(words) or type(exc).__name__)


def _printable(text: str) -> str:
    """`text` as printable ASCII, cut to a reason's length."""
    shown = text.encode("ascii", "backslashreplace").decode()
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in shown)
    return shown if len(shown) <= _REASON_CHARS else shown[: _REASON_CHARS - 3] + "..."


# aiohttp answers HTTP its parser refuses from RequestHandler.handle_error, in plain text, before
# any route or middleware (and a broken chunk that arrives while a route reads the body, with
# the C parser, not at all: the route waits for the rest forever); it also answers an HTTP error
# raised outside the middleware (an unknown Expect) in plain text. It has no hook for either
# (aio-libs/aiohttp#3287, #6463): the bridge's connections are a RequestHandler of its own.
# Checked against aiohttp 3.14.5 (pinned); tests/system/test_malformed_http.py fails if these
# seams move.


class _Connection(web.RequestHandler):
    """One connection to the bridge: every refusal in the JSON error shape."""

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if isinstance(exc, HttpProcessingError) and request.writer.output_size == 0:
            log.debug("refused malformed HTTP from %s: %r", request.remote, exc)
            return malformed_http_response(exc)
        return super().handle_error(request, status, exc, message)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        refused = self._messages[-1][0] if self._messages else None
        if not isinstance(refused, _ErrInfo):
            return
        # The parser dropped the body it was reading: fail it as aiohttp fails a body it reads
        # wrong, so whoever reads it is answered.
        bodies = [payload for _, payload in self._messages]
        if self._current_request is not None:
            bodies.append(self._current_request.content)
        for body in bodies:
            if not body.is_eof():
                failure = web.RequestPayloadError(str(refused.exc))
                failure.__cause__ = refused.exc
                body.set_exception(failure)

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        if isinstance(resp, web.HTTPException) and resp.status >= 400:
            resp = http_error_response(request, resp)  # raised outside the middleware
        return await super().finish_response(request, resp, start_time)


class _Server(web.Server):
    """aiohttp's Server, making a _Connection for each connection."""

    def __call__(self) -> web.RequestHandler:
        return _Connection(self, loop=self._loop, **self._kwargs)


class BridgeRunner(web.AppRunner):
    """An AppRunner whose connections answer every refusal in the JSON error shape."""

    def __init__(self, app: web.Application) -> None:
        super().__init__(
            app, access_log=None, max_line_size=MAX_LINE_BYTES, max_field_size=MAX_LINE_BYTES
        )

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # aiohttp takes no class to make connections with: this server is the same but for that.
        server.__class__ = _Server
        return server
