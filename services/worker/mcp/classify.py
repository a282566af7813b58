"""Why an MCP request failed, from what the SDK raised and what the HTTP layer saw: a reason
the model can act on, and whether the call is known not to have run."""

from __future__ import annotations

from collections.abc import Sequence

import httpx2
import pydantic
from mcp.shared.exceptions import MCPError
from mcp_types import (
    CONNECTION_CLOSED,
    INTERNAL_ERROR,
    INVALID_REQUEST,
    PARSE_ERROR,
    REQUEST_TIMEOUT,
)

from services.worker.mcp.connection import Seen
from services.worker.mcp.outcome import McpFailure, McpOutcome, failed

CONNECT_FAILURES = (httpx2.ConnectError, httpx2.ConnectTimeout)
"""A request that failed so never reached the server."""


def expired_session(exc: BaseException, seen: Sequence[Seen]) -> bool:
    """Whether `exc` is the server answering 404 to our session id: the session is gone."""
    return isinstance(exc, MCPError) and any(s.status == 404 and s.had_session for s in seen)


def connection_closed(exc: BaseException) -> bool:
    """Whether `exc` says the session's transport has closed (its session is unusable), not
    only one request's stream ("SSE stream ended without a response", same code): the SDK's
    dispatcher answers every waiter, and every later request, so once it is closed."""
    return (
        isinstance(exc, MCPError)
        and exc.code == CONNECTION_CLOSED
        and exc.message == "Connection closed"
    )


def classify(exc: BaseException, seen: Sequence[Seen], *, definite: bool) -> McpOutcome:
    """The failure `exc` means. `definite` is whether the request is known not to have reached
    the tool when the failure itself does not say (True while a session is being opened)."""
    detail = f"{type(exc).__name__}: {exc}"[:500]
    denial = next((s for s in reversed(seen) if s.status in (401, 403)), None)
    if denial is not None:
        what = "a token with more scope" if denial.status == 403 else "authorisation"
        return failed(
            McpFailure.UNAUTHORISED,
            f"the MCP server wants {what} (HTTP {denial.status}): the run needs a connection",
            definite=True,
            detail=detail,
        )
    if isinstance(exc, CONNECT_FAILURES):
        return failed(
            McpFailure.SERVER_DOWN,
            "the MCP server cannot be reached (nothing was sent); try again later",
            definite=True,
            detail=detail,
        )
    if isinstance(exc, httpx2.TimeoutException | TimeoutError):
        return _timeout(detail)
    if isinstance(exc, httpx2.TransportError | ConnectionError):
        return _lost(detail)
    if isinstance(exc, MCPError):
        return _jsonrpc(exc, seen, definite, detail)
    if isinstance(exc, pydantic.ValidationError | RuntimeError | ValueError):
        return _garbage(definite, detail)
    return _lost(detail)


def _jsonrpc(exc: MCPError, seen: Sequence[Seen], definite: bool, detail: str) -> McpOutcome:
    if exc.code == REQUEST_TIMEOUT:
        return _timeout(detail)
    if exc.code == CONNECTION_CLOSED:
        return _lost(detail)
    if exc.code == PARSE_ERROR:
        return _garbage(definite, detail)
    status = next((s.status for s in reversed(seen) if s.status >= 500), None)
    if status is not None and exc.code == INTERNAL_ERROR:
        return failed(
            McpFailure.SERVER_DOWN,
            f"the MCP server answered HTTP {status} (unavailable); try again later",
            definite=definite,
            detail=detail,
        )
    if exc.code == INVALID_REQUEST and "content type" in exc.message.lower():
        return _garbage(definite, detail)
    return failed(
        McpFailure.REJECTED,
        f"the MCP server refused the request: {exc.message[:300]} (JSON-RPC {exc.code})",
        definite=True,
        detail=detail,
    )


def _timeout(detail: str) -> McpOutcome:
    return failed(
        McpFailure.TIMEOUT,
        "the MCP server did not answer in time; the call may have run",
        definite=False,
        detail=detail,
    )


def _lost(detail: str) -> McpOutcome:
    return failed(
        McpFailure.CONNECTION_LOST,
        "the connection to the MCP server broke before it answered; the call may have run",
        definite=False,
        detail=detail,
    )


def _garbage(definite: bool, detail: str) -> McpOutcome:
    return failed(
        McpFailure.PROTOCOL,
        "the MCP server answered something that is not MCP; it may be misconfigured",
        definite=definite,
        detail=detail,
    )
