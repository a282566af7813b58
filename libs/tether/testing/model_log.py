"""The local model server's request log and its error answers: what each request to
`/v1/messages` looked like and how its response ended, and the API-shaped errors it sends."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web

from tether.testing.model_script import KEY_HEADER, ErrorTurn
from tether.testing.model_wire import error_body, error_type_for_status

LOGGED_HEADERS = (
    "anthropic-version",
    "anthropic-beta",
    "content-type",
    "idempotency-key",
    "user-agent",
    "x-stainless-retry-count",
    "x-stainless-timeout",
    "x-stainless-read-timeout",
    "x-stainless-helper-method",
    "x-stainless-stream-helper",
    KEY_HEADER,
)
"""Request headers kept in the log. Credentials are never logged, only which scheme was used."""


@dataclass
class RecordedRequest:
    """One request to `/v1/messages`, as the server saw it.

    `served` says what answered (`script`, `demo`, or the rejection such as `auth_error`);
    `outcome` how the response ended: `pending` while it is being sent, then `ok`,
    `error_status`, `mid_stream_error`, `truncated`, `cut`, `disconnected` (the client went
    away first) or `server_stopped`. `usage` is what the answer reported (the prompt cache's
    reads and writes among it), once there was one.
    """

    method: str
    path: str
    headers: dict[str, str]
    auth: str | None
    body: Any
    timestamp: float
    script_key: str
    served: str = "pending"
    outcome: str = "pending"
    request_id: str = ""
    stream: bool = False
    usage: dict[str, int] | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON form served by `GET /_requests`."""
        return {
            "method": self.method,
            "path": self.path,
            "headers": self.headers,
            "auth": self.auth,
            "body": self.body,
            "timestamp": self.timestamp,
            "script_key": self.script_key,
            "served": self.served,
            "outcome": self.outcome,
            "request_id": self.request_id,
            "stream": self.stream,
            "usage": self.usage,
        }


def auth_scheme(request: web.Request) -> str | None:
    if request.headers.get("x-api-key"):
        return "x-api-key"
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return "bearer"
    return None


def abort_connection(request: web.Request) -> None:
    """Drop the TCP connection without finishing the body (no final zero-length chunk)."""
    if request.transport is not None:
        request.transport.abort()


def error_response(
    status: int,
    error_type: str,
    message: str | None,
    request_id: str,
    record: RecordedRequest,
    headers: dict[str, str] | None = None,
) -> web.Response:
    record.outcome = "error_status"
    return web.json_response(
        error_body(error_type, message, request_id),
        status=status,
        headers={"request-id": request_id, **(headers or {})},
    )


def scripted_error(turn: ErrorTurn, request_id: str, record: RecordedRequest) -> web.Response:
    headers = dict(turn.headers)
    if turn.retry_after is not None:
        headers["retry-after"] = _header_number(turn.retry_after)
    if turn.retry_after_ms is not None:
        headers["retry-after-ms"] = _header_number(turn.retry_after_ms)
    if turn.should_retry is not None:
        headers["x-should-retry"] = "true" if turn.should_retry else "false"
    error_type = turn.error_type or error_type_for_status(turn.status)
    return error_response(turn.status, error_type, turn.message, request_id, record, headers)


def _header_number(value: float | str) -> str:
    """`2` rather than `2.0`, as a server would write it; strings (HTTP dates) pass through."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
