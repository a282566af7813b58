"""The Messages API's event stream, read lean: the SDK makes the request (its auth, headers,
timeouts and error classes for a refused one), and the body is read here as plain dicts.

The SDK's own stream builds a typed model for every event (a JSON parse, then pydantic) that the
worker only reads once and drops; measured here, that is a quarter of a short streamed call's
client CPU, and it grows with every delta. The framing follows the SDK's `SSEDecoder` (see
`../shared/reference/anthropic-wire-facts.md`, section 2), and `tests/unit/test_sse.py` holds
this reader to the SDK's on the same bytes, however they are chunked: events end at a blank
line (LF, CRLF or CR line ends), and one the body ends inside of is dropped; `:` starts a
comment; `data:` lines join with a newline; one space after the colon is dropped; an event
needs an `event:` line; `ping` and empty events are skipped; an `error` event raises the
`anthropic.APIStatusError` the SDK raises for it (status 200, its body the event's JSON).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anthropic
import httpx2

_LINE_ENDS = (b"\n", b"\r")


@dataclass
class AnswerHeaders:
    """An answer's rate-limit headers, by lower-case name, and when they arrived (the monotonic
    clock; None until they have)."""

    values: dict[str, str] = field(default_factory=dict)
    arrived: float | None = None

    def age_s(self) -> float:
        """Seconds since they arrived (0 when they have not)."""
        return 0.0 if self.arrived is None else max(0.0, time.monotonic() - self.arrived)


async def events(
    client: anthropic.AsyncAnthropic,
    request: dict[str, Any],
    headers: AnswerHeaders | None = None,
) -> AsyncIterator[Any]:
    """Send `request` as a streamed Messages call; yield each event's JSON object. `headers`,
    when given, receives the answer's rate-limit headers (`anthropic-ratelimit-*`)."""
    async with client.messages.with_streaming_response.create(**request, stream=True) as response:
        http = response.http_response
        if headers is not None:
            headers.values.update(rate_limit_headers(http.headers))
            headers.arrived = time.monotonic()
        async for name, data in server_sent_events(http.aiter_bytes()):
            if name == "error":
                raise stream_error(data, http)
            if name is None or name == "ping" or not data:
                continue
            yield json.loads(data)


async def server_sent_events(
    chunks: AsyncIterator[bytes],
) -> AsyncIterator[tuple[str | None, bytes]]:
    """(event name or None, data) for each event the byte chunks carry."""
    decoder = Decoder()
    async for chunk in chunks:
        for event in decoder.feed(chunk):
            yield event
    for event in decoder.end():
        yield event


class Decoder:
    """Server-sent events out of bytes fed in pieces of any size."""

    def __init__(self) -> None:
        self._pending = b""  # a line not ended yet (or ended by a CR that may precede an LF)
        self._name: str | None = None
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> list[tuple[str | None, bytes]]:
        """The events completed by `chunk`."""
        lines = (self._pending + chunk).splitlines(keepends=True)
        self._pending = b""
        if lines and (not lines[-1].endswith(_LINE_ENDS) or lines[-1].endswith(b"\r")):
            self._pending = lines.pop()
        return [event for line in lines if (event := self._line(line)) is not None]

    def end(self) -> list[tuple[str | None, bytes]]:
        """The events the end of the body completes: those a blank line ended, in a last line
        without its line end (an event the body ends inside of is dropped, as the SDK drops
        it)."""
        lines = self._pending.splitlines(keepends=True)
        self._pending = b""
        return [event for line in lines if (event := self._line(line)) is not None]

    def _line(self, raw: bytes) -> tuple[str | None, bytes] | None:
        line = raw.rstrip(b"\r\n")
        if not line:
            if not self._name and not self._data:
                return None
            event = (self._name or None, b"\n".join(self._data))  # an empty name is none
            self._name, self._data = None, []
            return event
        if line.startswith(b":"):
            return None
        field, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if field == b"event":
            self._name = value.decode()
        elif field == b"data":
            self._data.append(value)
        return None  # `id` and `retry` mean nothing for one response


def stream_error(data: bytes, response: httpx2.Response) -> anthropic.APIStatusError:
    """The error an `error` event inside a started stream stands for, as the SDK raises it."""
    body: object
    try:
        body = json.loads(data)
        message = f"{body}"
    except ValueError:
        body = data.decode(errors="replace")
        message = str(body) or f"Error code: {response.status_code}"
    return anthropic.APIStatusError(message, response=response, body=body)


def rate_limit_headers(headers: Any) -> dict[str, str]:
    """The `anthropic-ratelimit-*` and `retry-after` headers of an answer, by lower-case name."""
    return {
        name.lower(): value
        for name, value in headers.items()
        if name.lower().startswith("anthropic-ratelimit-")
        or name.lower() in ("retry-after", "retry-after-ms")
    }
