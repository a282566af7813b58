"""Property: whatever an HTTP client sends to the bridge (hostile path segments, query strings
and headers; bodies that are valid, wrongly typed, not JSON or not UTF-8; routes and methods that
do not exist), the answer is never a 5xx, every error is the bridge's JSON error, and a refused
request writes nothing (the row count of every table before and after). Requests are generated
by hypothesis (seeded: derandomize), one to every route per example."""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import quote

import httpx2
import pytest
from google.protobuf import json_format
from hypothesis import strategies as st

from tests.system.bad_input_support import (
    HOSTILE_STRINGS,
    REQUESTS,
    WORDS,
    Answer,
    Generator,
    HostileStack,
    fuzz,
)
from tether.states import RunStatus
from tether.v1 import gateway_pb2

# An accepted stream sends its first frame (the snapshot, or a keepalive: 0.2 s here) well
# inside this.
FIRST_FRAME_S = 5.0

# (method, path with {id}, body message type or None, query names, streaming)
ROUTES: tuple[tuple[str, str, Any, tuple[str, ...], bool], ...] = (
    ("GET", "/v1/runs/{id}/events", None, ("after", "deltas"), True),
    ("GET", "/v1/conversations/{id}/events", None, ("cursor", "deltas"), True),
    ("POST", "/v1/messages", gateway_pb2.SendMessageRequest, (), False),
    ("GET", "/v1/runs", None, ("status", "conversation_id", "page_size", "page_token"), False),
    ("GET", "/v1/runs/{id}", None, (), False),
    ("POST", "/v1/runs/{id}/cancel", gateway_pb2.CancelRunRequest, (), False),
    ("GET", "/v1/runs/{id}/pending-question", None, (), False),
    ("GET", "/v1/runs/{id}/pending-approval", None, (), False),
    ("GET", "/v1/runs/{id}/pending-connection", None, (), False),
    ("POST", "/v1/runs/{id}/answer", gateway_pb2.AnswerQuestionRequest, (), False),
    ("POST", "/v1/runs/{id}/decision", gateway_pb2.DecideApprovalRequest, (), False),
    ("POST", "/v1/runs/{id}/connection", gateway_pb2.CompleteConnectionRequest, (), False),
    # No such route, or no such method on one.
    ("DELETE", "/v1/runs/{id}", None, (), False),
    ("PUT", "/v1/messages", gateway_pb2.SendMessageRequest, (), False),
    ("GET", "/v1/{id}", None, (), False),
)

JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**30), 10**30),
    st.floats(allow_nan=False),
    st.sampled_from(HOSTILE_STRINGS),
    st.text(max_size=20),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)


def body_strategy(generator: Generator, plain: Generator, message_type: Any) -> Any:
    """A request body: well-shaped JSON, hostile values, wrong types, or bytes that are not
    JSON at all."""
    field_names = [f.name for f in message_type.DESCRIPTOR.fields] + ["unknown_field"]

    def as_json(message: Any) -> bytes:
        data = json_format.MessageToDict(message, preserving_proto_field_name=True)
        return json.dumps(data).encode()

    wrong_types = st.dictionaries(st.sampled_from(field_names), JSON_VALUES, max_size=4).map(
        lambda d: json.dumps(d).encode()
    )
    broken = st.one_of(
        st.binary(max_size=60),
        st.sampled_from(
            [b"{", b"[" * 50_000, b'{"a":' * 5_000, b"\xff\xfe\x00{}", b"null", b"[]", b"1e999"]
        ),
        JSON_VALUES.map(lambda v: json.dumps(v).encode()),
    )
    return st.one_of(
        plain.messages(message_type.DESCRIPTOR).map(as_json),
        generator.messages(message_type.DESCRIPTOR).map(as_json),
        wrong_types,
        broken,
        st.just(b""),
    )


# aiohttp's parser refuses a request line past 8190 bytes before any route sees it (a plain 400:
# not HTTP, like an over-long header): the path segment and the (at most four) query values are
# kept within it, still far past every field's limit.
_SEGMENT_BYTES, _QUERY_VALUE_BYTES = 4096, 700


def _within(value: str, size: int) -> str:
    """`value`, shortened until its percent-encoding takes at most `size` bytes."""
    while len(quote(value, safe="")) > size:
        value = value[: len(value) * 3 // 4]
    return value


def segments(plain: Generator, hostile: Generator) -> Any:
    """A path segment, percent-encoded, or raw escapes of bytes that are not UTF-8."""
    return st.one_of(
        plain.strings.map(lambda s: quote(_within(s, _SEGMENT_BYTES), safe="")),
        hostile.strings.map(lambda s: quote(_within(s, _SEGMENT_BYTES), safe="")),
        st.binary(min_size=1, max_size=8).map(lambda b: "".join(f"%{c:02X}" for c in b)),
    )


def query_value(hostile: Generator) -> Any:
    return st.one_of(
        st.integers(-5, 60).map(str),
        st.integers(-(10**25), 10**25).map(str),
        st.sampled_from([v.value for v in RunStatus]),
        st.sampled_from(["0", "false", "+1", "1_0", "\u0661", " 1", "0x10", "1e3"]),
        hostile.strings.map(lambda s: _within(s, _QUERY_VALUE_BYTES)),
    )


# aiohttp's parser refuses a header line past 8190 bytes before any route sees it.
_HEADER_BYTES = 4096


def _header_bytes(value: str) -> bytes:
    # Control characters (and edge whitespace) or an over-long line make it not HTTP: the
    # client refuses to send it, or aiohttp's parser answers before any route (a plain 400).
    # Every other byte is sent.
    kept = bytes(b for b in value.encode() if b >= 0x20 and b != 0x7F)
    return kept.strip()[:_HEADER_BYTES].strip()


def header_value(strings: Any) -> Any:
    return strings.map(_header_bytes)


async def answer(
    http: httpx2.AsyncClient,
    route: tuple[str, str, Any, tuple[str, ...], bool],
    request: tuple[str, list[tuple[str, str]], dict[str, bytes], bytes],
) -> Answer:
    method, template, _, _, streaming = route
    segment, params, headers, body = request
    url = template.replace("{id}", segment)
    label = f"{method} {template}"
    try:
        async with http.stream(
            method, url, params=params, headers=headers, content=body or None
        ) as response:
            status = response.status_code
            if streaming and status == 200:
                async with asyncio.timeout(FIRST_FRAME_S):
                    first = await anext(response.aiter_bytes())
                good = response.headers["content-type"].startswith("text/event-stream")
                return Answer(f"{label} 200", True, None if good and first else "not an SSE stream")
            content = await response.aread()
    except TimeoutError:
        return Answer(f"{label} silent", True, "an open stream sent nothing")
    if status < 400:
        return Answer(f"{label} {status}", True)
    return Answer(f"{label} {status}", False, _error_problem(status, response, content))


def _error_problem(status: int, response: httpx2.Response, content: bytes) -> str | None:
    if status >= 500:
        return f"HTTP {status}: {content[:300]!r}"
    if not response.headers.get("content-type", "").startswith("application/json"):
        return f"HTTP {status} without the JSON error shape: {content[:300]!r}"
    try:
        error = json.loads(content)["error"]
        if all(isinstance(error.get(k), str) and error[k] for k in ("status", "code", "message")):
            return None
    except (ValueError, KeyError, TypeError):
        pass
    return f"HTTP {status} body is not the JSON error shape: {content[:300]!r}"


@pytest.mark.timeout(600)
@pytest.mark.filterwarnings("ignore:Generating overly large repr")  # requests past size limits
async def test_no_http_request_is_a_5xx_or_writes_when_refused(
    hostile_stack: HostileStack,
) -> None:
    stack = hostile_stack
    seeds = (*stack.run_ids, *stack.conversation_ids, *WORDS, "run_" + "0" * 32)
    hostile, plain = Generator(seeds, hostile=True), Generator(seeds, hostile=False)
    keys = [stack.key_a] * 6 + [stack.admin_key, stack.read_only_key, stack.key_b, "tk_forged"]
    authorization = st.one_of(
        st.sampled_from([f"Bearer {k}" for k in keys] + ["", "Bearer", "Basic abc"]).map(
            str.encode
        ),
        header_value(hostile.strings),
    )
    per_route = []
    for route in ROUTES:
        _, _, message_type, query_names, _ = route
        params = (
            st.lists(st.tuples(st.sampled_from(query_names), query_value(hostile)), max_size=4)
            if query_names
            else st.just([])
        )
        headers = st.fixed_dictionaries(
            {"Authorization": authorization},
            optional={
                "Last-Event-ID": header_value(hostile.strings),
                "Idempotency-Key": header_value(st.one_of(plain.strings, hostile.strings)),
                "Content-Type": st.sampled_from([b"application/json", b"text/plain"]),
            },
        )
        body = body_strategy(hostile, plain, message_type) if message_type else st.just(b"")
        per_route.append(
            st.tuples(st.just(route), st.tuples(segments(plain, hostile), params, headers, body))
        )
    batches = st.tuples(*per_route)
    async with httpx2.AsyncClient(base_url=stack.http_base, timeout=30) as http:
        seen = await asyncio.to_thread(
            fuzz,
            stack,
            asyncio.get_running_loop(),
            batches,
            len(ROUTES),
            lambda r: answer(http, *r),
        )
    assert seen.total() >= REQUESTS
    for method, template, *_ in ROUTES:
        label = f"{method} {template}"
        assert (
            sum(n for k, n in seen.items() if k.startswith(label + " "))
            >= REQUESTS // len(ROUTES) // 2
        )
    statuses = {
        code: sum(n for k, n in seen.items() if k.endswith(f" {code}"))
        for code in (200, 400, 401, 404)
    }
    # Most requests reach validation: a sixth at least is refused by it (a 400), not only by
    # authentication or routing.
    assert statuses[400] >= REQUESTS // 6, seen
    assert min(statuses[200], statuses[401], statuses[404]) >= REQUESTS // 100, seen
