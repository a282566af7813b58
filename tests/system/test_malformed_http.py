"""Malformed HTTP sent as raw bytes to the gateway's HTTP bridge (services as processes): what
aiohttp's parser refuses before any route runs (an over-long line, a control character, a bad
Content-Length or chunk, not HTTP at all), a body that cannot be decoded, and a broken chunk that
arrives while the body is being read. Each is the bridge's JSON error with a 4xx status and a
message a person can act on, and writes nothing. Every request would be a valid SendMessage
from an authenticated caller if it were well formed, so a lenient parser would write a run."""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any

import pytest

from tests.system.bad_input_support import HostileStack

# A refused request is answered at once; this only bounds a server that never answers.
ANSWER_TIMEOUT_S = 10.0
# aiohttp's limit on the request line and on each header (name and value).
LINE_LIMIT = 8190


def message_body() -> bytes:
    """A SendMessage body that would admit a run of its own."""
    unique = uuid.uuid4().hex
    return json.dumps(
        {"event_id": f"raw-{unique}", "conversation_id": f"raw-{unique}", "text": "hello"}
    ).encode()


def send_message(key: str, *, head: bytes = b"") -> bytes:
    """A SendMessage over HTTP, well formed but for what `head` (header lines) adds."""
    body = message_body()
    return (
        b"POST /v1/messages HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {key}\r\n".encode()
        + head
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )


def chunked(key: str, chunks: bytes) -> bytes:
    """A SendMessage whose body is sent chunked as `chunks`, exactly as given."""
    return (
        b"POST /v1/messages HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {key}\r\n".encode()
        + b"Transfer-Encoding: chunked\r\n\r\n"
        + chunks
    )


def valid_chunks() -> bytes:
    body = message_body()
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


@dataclass(frozen=True)
class Case:
    request: Any  # (key) -> the raw bytes
    message: str  # what the error message says (a fragment)
    status: int = 400
    code: str = "malformed_http"


CASES: dict[str, Case] = {
    "request line over the limit": Case(
        lambda key: send_message(key).replace(
            b"/v1/messages", b"/v1/messages?pad=" + b"x" * LINE_LIMIT, 1
        ),
        f"longer than {LINE_LIMIT} bytes",
        code="line_too_long",
    ),
    "a header value over the limit": Case(
        lambda key: send_message(key, head=b"X-Pad: " + b"x" * (LINE_LIMIT + 1) + b"\r\n"),
        f"longer than {LINE_LIMIT} bytes",
        code="line_too_long",
    ),
    "too many headers": Case(
        lambda key: send_message(key, head=b"".join(b"X-%d: a\r\n" % i for i in range(200))),
        "headers",
    ),
    "control character in a header value": Case(
        lambda key: send_message(key, head=b"X-Note: a\x01b\r\n"), "header"
    ),
    "NUL in a header value": Case(
        lambda key: send_message(key, head=b"X-Note: a\x00b\r\n"), "header"
    ),
    "control character in a header name": Case(
        lambda key: send_message(key, head=b"X\x01Note: ab\r\n"), "header"
    ),
    "control character in the request line": Case(
        lambda key: send_message(key).replace(b"/v1/messages", b"/v1/mess\x01ages", 1), "URL"
    ),
    "not a number as Content-Length": Case(
        lambda key: send_message(key).replace(b"Content-Length: ", b"Content-Length: x", 1),
        "Content-Length",
    ),
    "two Content-Lengths": Case(
        lambda key: send_message(key, head=b"Content-Length: 1\r\n"), "Content-Length"
    ),
    "Content-Length with chunked": Case(
        lambda key: chunked(key, valid_chunks()).replace(
            b"\r\n\r\n", b"\r\nContent-Length: 5\r\n\r\n", 1
        ),
        "Content-Length",
    ),
    "a chunk size that is not hex": Case(
        lambda key: chunked(key, b"zz\r\n{}\r\n0\r\n\r\n"), "chunk"
    ),
    "a chunk longer than its size": Case(
        lambda key: chunked(key, b"1\r\n{}\r\n0\r\n\r\n"), "chunk"
    ),
    "an unknown Transfer-Encoding": Case(
        lambda key: chunked(key, b"{}").replace(b"chunked", b"gzip, x-unknown", 1),
        "Transfer-Encoding",
    ),
    "no Host in HTTP/1.1": Case(
        lambda key: send_message(key).replace(b"Host: gateway\r\n", b"", 1), "Host"
    ),
    "an HTTP version that does not exist": Case(
        lambda key: send_message(key).replace(b"HTTP/1.1", b"HTTP/1.x", 1), "version"
    ),
    "TLS to the plain-HTTP port": Case(
        lambda key: b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 32, "HTTPS"
    ),
    "a gzip body that is not gzip": Case(
        lambda key: send_message(key, head=b"Content-Encoding: gzip\r\n"),
        "Content-Encoding",
        code="bad_content_encoding",
    ),
    "a deflate body that is not deflate": Case(
        lambda key: send_message(key, head=b"Content-Encoding: deflate\r\n"),
        "Content-Encoding",
        code="bad_content_encoding",
    ),
    "an Expect the bridge does not know": Case(
        lambda key: send_message(key, head=b"Expect: teapot\r\n"),
        "100-continue",
        status=417,
        code="expectation_failed",
    ),
}


@dataclass(frozen=True)
class RawAnswer:
    status: int
    headers: dict[str, str]
    body: bytes

    def error(self) -> dict[str, Any]:
        """The JSON error, checked to have the bridge's shape."""
        content_type = self.headers.get("content-type", "")
        assert content_type.startswith("application/json"), (self.status, self.body[:300])
        error = json.loads(self.body)["error"]
        assert isinstance(error, dict), self.body[:300]
        for name in ("status", "code", "message"):
            assert isinstance(error.get(name), str) and error[name], error
        return error


async def read_answer(reader: asyncio.StreamReader) -> RawAnswer:
    """One response: its head, then the body its Content-Length gives."""
    status_line, *lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = {}
    for line in filter(None, lines):
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return RawAnswer(int(status_line.split(" ")[1]), headers, body)


async def exchange(stack: HostileStack, *parts: bytes) -> RawAnswer:
    """Send `parts` on one connection (after the first, each once the server has answered
    100 Continue) and read the answer."""
    host, port = stack.services.http_addresses()["gateway"].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        async with asyncio.timeout(ANSWER_TIMEOUT_S):
            first, *rest = parts
            writer.write(first)
            for part in rest:
                interim = await read_answer(reader)
                assert interim.status == 100, interim
                writer.write(part)
            return await read_answer(reader)
    except TimeoutError:
        pytest.fail(f"no answer within {ANSWER_TIMEOUT_S} s")
    finally:
        writer.close()


@pytest.mark.parametrize("name", list(CASES))
async def test_malformed_http_is_a_json_error_and_writes_nothing(
    hostile_stack: HostileStack, name: str
) -> None:
    case = CASES[name]
    before = await hostile_stack.row_counts()
    answer = await exchange(hostile_stack, case.request(hostile_stack.key_a))
    assert answer.status == case.status, (answer.status, answer.body[:300])
    error = answer.error()
    assert (error["status"], error["code"]) == ("INVALID_ARGUMENT", case.code), error
    assert case.message.lower() in error["message"].lower(), error
    assert await hostile_stack.row_counts() == before


async def test_a_broken_chunk_sent_while_the_body_is_read_is_a_json_error(
    hostile_stack: HostileStack,
) -> None:
    """The head is parsed and the route is reading the body (it answered 100 Continue) when the
    broken chunk arrives: the read fails and the answer is still the JSON error."""
    before = await hostile_stack.row_counts()
    head = chunked(hostile_stack.key_a, b"").replace(
        b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n", 1
    )
    answer = await exchange(hostile_stack, head, b"zz\r\n{}\r\n0\r\n\r\n")
    assert answer.status == 400, (answer.status, answer.body[:300])
    error = answer.error()
    assert (error["status"], error["code"]) == ("INVALID_ARGUMENT", "malformed_http"), error
    assert "chunk" in error["message"], error
    assert await hostile_stack.row_counts() == before


async def test_a_well_formed_raw_request_is_accepted(hostile_stack: HostileStack) -> None:
    """The requests above are refused for what they break, not for how they are sent."""
    for request in (
        send_message(hostile_stack.key_a),
        chunked(hostile_stack.key_a, valid_chunks()),
    ):
        answer = await exchange(hostile_stack, request)
        assert answer.status == 200, (answer.status, answer.body[:300])
        assert json.loads(answer.body)["disposition"] == "created"


def to_v2(request: bytes) -> bytes:
    return request.replace(b"POST /v1/messages", b"POST /v2/messages", 1)


@pytest.mark.parametrize("name", [n for n in CASES if b"/v1/messages" in CASES[n].request("k")])
async def test_malformed_http_to_v2_is_the_same_json_error_and_writes_nothing(
    hostile_stack: HostileStack, name: str
) -> None:
    case = CASES[name]
    before = await hostile_stack.row_counts()
    answer = await exchange(hostile_stack, to_v2(case.request(hostile_stack.key_a)))
    assert answer.status == case.status, (answer.status, answer.body[:300])
    error = answer.error()
    assert (error["status"], error["code"]) == ("INVALID_ARGUMENT", case.code), error
    assert await hostile_stack.row_counts() == before


async def test_a_well_formed_raw_request_to_v2_is_accepted(hostile_stack: HostileStack) -> None:
    answer = await exchange(hostile_stack, to_v2(send_message(hostile_stack.key_a)))
    assert answer.status == 200, (answer.status, answer.body[:300])
    assert json.loads(answer.body)["disposition"] == "DISPOSITION_CREATED"
    assert answer.headers["cache-control"] == "no-store"
