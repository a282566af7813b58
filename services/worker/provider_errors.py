"""What a model call's exception was, in Tether's terms: the worker's half of the retry policy.

The classification needs the provider SDK's exception types; the policy it feeds
(`tether.retry`) does not, so only the worker imports the SDK. Which failures are retryable is
described in `tether.retry`'s module docstring.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import anthropic
import httpx2

from tether.retry import ProviderCode, ProviderFailure, parse_retry_after, should_retry_status

RETRYABLE_STREAM_ERRORS = frozenset({"overloaded_error", "api_error", "rate_limit_error"})
"""Mid-stream `error` event types that are transient on the provider's side."""


class StreamIncomplete(Exception):
    """A stream ended cleanly before `message_stop`.

    The SDK raises nothing in this case (its final message just has `stop_reason=None`), so
    the provider adapter raises this itself; `classify_exception` treats it as retryable.
    """


def classify_exception(
    exc: BaseException, *, now: Callable[[], float] = time.time
) -> ProviderFailure:
    """Translate an exception from a model call into a `ProviderFailure`.

    Walks the `__cause__` chain (as the SDK does), so an adapter's `raise X from exc` keeps
    the classification. Do not classify `asyncio.CancelledError`: re-raise it instead.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        failure = _classify_one(current, now)
        if failure is not None:
            return failure
        current = current.__cause__
    return ProviderFailure(ProviderCode.ERROR, _describe(exc), retryable=False, status=0)


def _classify_one(exc: BaseException, now: Callable[[], float]) -> ProviderFailure | None:
    if isinstance(exc, StreamIncomplete):
        message = str(exc) or "stream ended before message_stop"
        return ProviderFailure(ProviderCode.STREAM_INCOMPLETE, message, True, 200)
    if isinstance(exc, anthropic.APIStatusError):
        return _classify_status(exc, now)
    # Order matters below: APITimeoutError is an APIConnectionError, and every httpx2 case
    # is a TransportError.
    if isinstance(exc, anthropic.APITimeoutError | httpx2.TimeoutException):
        # A raw httpx2.ReadTimeout comes from a stream that stalled after it started.
        return ProviderFailure(ProviderCode.TIMEOUT, _describe(exc), True, 0)
    if isinstance(exc, anthropic.APIConnectionError):
        return ProviderFailure(ProviderCode.CONNECTION, _describe(exc), True, 0)
    if isinstance(exc, httpx2.RemoteProtocolError | httpx2.ReadError):
        # Raised raw by the SDK only once a stream has started: the body was cut off.
        return ProviderFailure(ProviderCode.STREAM_CUT, _describe(exc), True, 200)
    if isinstance(exc, httpx2.TransportError):
        return ProviderFailure(ProviderCode.CONNECTION, _describe(exc), True, 0)
    return None


_CODE_BY_STATUS: Mapping[int, ProviderCode] = {
    400: ProviderCode.BAD_REQUEST,
    401: ProviderCode.AUTH,
    402: ProviderCode.BILLING,
    403: ProviderCode.AUTH,
    404: ProviderCode.BAD_REQUEST,
    408: ProviderCode.TIMEOUT,
    409: ProviderCode.CONFLICT,
    413: ProviderCode.BAD_REQUEST,
    422: ProviderCode.BAD_REQUEST,
    429: ProviderCode.RATE_LIMITED,
    504: ProviderCode.TIMEOUT,
    529: ProviderCode.OVERLOADED,
}

_CODE_BY_ERROR_TYPE: Mapping[str, ProviderCode] = {
    "invalid_request_error": ProviderCode.BAD_REQUEST,
    "request_too_large": ProviderCode.BAD_REQUEST,
    "not_found_error": ProviderCode.BAD_REQUEST,
    "authentication_error": ProviderCode.AUTH,
    "permission_error": ProviderCode.AUTH,
    "billing_error": ProviderCode.BILLING,
    "conflict_error": ProviderCode.CONFLICT,
    "rate_limit_error": ProviderCode.RATE_LIMITED,
    "api_error": ProviderCode.SERVER_ERROR,
    "timeout_error": ProviderCode.TIMEOUT,
    "overloaded_error": ProviderCode.OVERLOADED,
}


def _classify_status(exc: anthropic.APIStatusError, now: Callable[[], float]) -> ProviderFailure:
    status = exc.status_code
    error_type = exc.type if isinstance(exc.type, str) else None
    message = exc.api_message or exc.message
    if status == 200:
        # An `error` event inside a started stream: only its type says what happened, and the
        # 200 response's headers carry no retry advice for it.
        code = _CODE_BY_ERROR_TYPE.get(error_type or "", ProviderCode.ERROR)
        retryable = error_type in RETRYABLE_STREAM_ERRORS
        return ProviderFailure(code, message, retryable, 200, None, error_type, exc.request_id)
    headers = exc.response.headers
    if error_type == "overloaded_error":
        code = ProviderCode.OVERLOADED
    elif status in _CODE_BY_STATUS:
        code = _CODE_BY_STATUS[status]
    else:
        code = ProviderCode.SERVER_ERROR if status >= 500 else ProviderCode.ERROR
    server_wait = parse_retry_after(headers, now=now)
    return ProviderFailure(
        code=code,
        message=message,
        retryable=should_retry_status(status, headers),
        status=status,
        retry_after=server_wait if server_wait is not None and server_wait > 0 else None,
        error_type=error_type,
        request_id=exc.request_id,
    )


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
