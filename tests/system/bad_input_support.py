"""What the bad-input tests and the fuzz suites share: one stack as real processes (no worker:
runs stay queued, so only a call itself can write), the row count of every table in one
statement, hostile values, and the check that an HTTP answer is the bridge's JSON error."""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import httpx2
import pytest
import pytest_asyncio
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.conftest import drop_database
from tests.system.stack_support import seeded_database
from tether import credentials
from tether.db.engine import create_engine
from tether.db.schema import metadata
from tether.stack.processes import ServiceSet
from tether.v1 import gateway_pb2, gateway_pb2_grpc

GATEWAY_SERVICE = "tether.v1.GatewayService"
R = TypeVar("R")

_COUNT_EVERY_TABLE = select(
    *[
        select(func.count()).select_from(table).scalar_subquery().label(table.name)
        for table in metadata.sorted_tables
    ]
)


@dataclass
class HostileStack:
    """The services on their own database, keys of several kinds and a few queued runs."""

    services: ServiceSet
    engine: AsyncEngine
    key_a: str
    key_b: str
    admin_key: str
    read_only_key: str
    run_ids: tuple[str, ...]
    conversation_ids: tuple[str, ...]

    @property
    def gateway(self) -> str:
        return self.services.addresses()["gateway"]

    @property
    def http_base(self) -> str:
        return f"http://{self.services.http_addresses()['gateway']}"

    def metadata(self, key: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {key}"),)

    async def row_counts(self) -> dict[str, int]:
        """The number of rows in every table of the schema (one statement)."""
        async with self.engine.connect() as conn:
            return dict((await conn.execute(_COUNT_EVERY_TABLE)).one()._mapping)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def hostile_stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[HostileStack]:
    """One stack for every bad-input module (starting one costs more than all their calls)."""
    seeded = await seeded_database(pg_server_url, template_db)
    engine = create_engine(seeded.url, pool_size=1)
    services = ServiceSet(
        Path(tmp_path_factory.mktemp("hostile")),
        {
            "TETHER_DATABASE_URL": seeded.url,
            "TETHER_REDIS_URL": redis_url,
            # The secret store's RPCs reach the store, not its refusal for want of a key.
            "TETHER_SECRETS_KEY": credentials.new_secrets_key(),
            # A quiet stream that was accepted says so soon (its first keepalive).
            "TETHER_GATEWAY_KEEPALIVE_INTERVAL_S": "0.2",
        },
        credentials.generate(),
    )
    try:
        await services.start_all(("orchestrator", "admission", "interactions", "gateway"))
        runs = []
        async with grpc.aio.insecure_channel(services.addresses()["gateway"]) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            for i, (key, conversation) in enumerate(
                [(seeded.key_a, "conv-1"), (seeded.key_a, "conv-2"), (seeded.key_b, "conv-1")]
            ):
                sent = await stub.SendMessage(
                    gateway_pb2.SendMessageRequest(
                        event_id=f"seed-{i}", conversation_id=conversation, text="hello"
                    ),
                    metadata=(("authorization", f"Bearer {key}"),),
                )
                runs.append(sent.run.run_id)
        yield HostileStack(
            services,
            engine,
            seeded.key_a,
            seeded.key_b,
            seeded.admin_key,
            seeded.read_only_key,
            tuple(runs),
            ("conv-1", "conv-2"),
        )
    finally:
        await services.stop_all()
        await engine.dispose()
        await drop_database(pg_server_url, seeded.name)


def assert_json_error(response: httpx2.Response, status: int, grpc_status: str) -> None:
    """`response` is the bridge's JSON error with this HTTP status and gRPC status name."""
    assert response.status_code == status, (response.status_code, response.text[:300])
    assert_error_shape(response)
    assert response.json()["error"]["status"] == grpc_status, response.text[:300]


def assert_error_shape(response: httpx2.Response) -> None:
    """`response` carries `{"error": {"status", "code", "message"}}` as JSON."""
    content_type = response.headers.get("content-type", "")
    assert content_type.startswith("application/json"), (response.status_code, content_type)
    error = response.json()["error"]
    for name in ("status", "code", "message"):
        assert isinstance(error.get(name), str) and error[name], error


# Values a caller might send, chosen to break things: control characters, a trailing newline,
# NUL, right-to-left marks, SQL, paths, sizes just past each limit, and near-misses of valid ids.
HOSTILE_STRINGS: tuple[str, ...] = (
    "",
    " ",
    "\n",
    "a\n",
    "run_x\n",
    "\nrun_x",
    "a\r\nb",
    "a\x00b",
    "\x00",
    "\x7f",
    "\x1b[31m",
    "tab\there",
    "\u202eevil",
    "\ufeffbom",
    "\U0001f642",
    "é",
    "a b",
    "../../etc/passwd",
    "'; DROP TABLE runs; --",
    "%00",
    "%ff",
    "${jndi:x}",
    "<script>",
    "-leading-dash",
    ".dot",
    "x" * 129,
    "x" * 513,
    "x" * 1001,
    "x" * 4001,
    "x" * 32_001,
    "y" * 70_000,
    "tk_" + "a" * 43,
)


@dataclass(frozen=True)
class Answer:
    """How the stack answered one generated request."""

    label: str  # what to count it under, e.g. "GetRun INVALID_ARGUMENT"
    accepted: bool  # accepted requests may write; refused ones never
    problem: str | None = None  # why the answer itself is wrong (INTERNAL, a 500, no JSON, ...)


# Generated requests per surface: 500 in `make test` (sized to its 15 minutes); `make fuzz`
# (run by .ci/run after it) sends the 2,000 per surface the issue asks for.
REQUESTS = int(os.environ.get("TETHER_FUZZ_REQUESTS", "500"))


def fuzz(
    stack: HostileStack,
    loop: asyncio.AbstractEventLoop,
    batches: st.SearchStrategy[tuple[R, ...]],
    batch_size: int,
    send: Callable[[R], Awaitable[Answer]],
) -> Counter[str]:
    """Send at least REQUESTS generated requests one at a time (hypothesis, seeded; each example
    is a batch, since the engine's own cost per example is several times a request's), failing
    on a wrong answer or on a refused request after which any table's row count changed.
    Blocking: run it in a thread (`asyncio.to_thread`) while `loop`, the stack's, does the I/O."""
    seen: Counter[str] = Counter()
    baseline = asyncio.run_coroutine_threadsafe(stack.row_counts(), loop).result()

    async def run(batch: tuple[R, ...]) -> list[str]:
        nonlocal baseline
        failures = []
        for request in batch:
            answer = await send(request)
            seen[answer.label] += 1
            after = await stack.row_counts()
            if answer.problem is not None:
                failures.append(f"{answer.label}: {answer.problem} for {request!r:.600}")
            elif not answer.accepted and after != baseline:
                changed = {t: (baseline[t], n) for t, n in after.items() if baseline[t] != n}
                failures.append(f"{answer.label} wrote {changed} for {request!r:.600}")
            baseline = after
        return failures

    @settings(
        max_examples=-(-REQUESTS // batch_size),
        derandomize=True,
        database=None,
        deadline=None,
        phases=(Phase.generate, Phase.shrink),
        suppress_health_check=list(HealthCheck),
    )
    @given(batch=batches)
    def check(batch: tuple[R, ...]) -> None:
        failures = asyncio.run_coroutine_threadsafe(run(batch), loop).result(timeout=120)
        assert not failures, failures

    check()
    return seen


# -- generated requests -------------------------------------------------------------------

# Identifier-shaped (the first character may still be a mark: the shape's edge is fuzzed too).
IDENTIFIERS = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:@-",
    min_size=1,
    max_size=24,
)
WORDS = (
    "allow-once",
    "allow-conversation",
    "allow-always",
    "deny",
    "principal",
    "tenant",
    "category",
    "runs:read",
    "runs:write",
    "admin",
    "chat",
    "whatsapp",
    "done",
)


def strings(seeds: tuple[str, ...]) -> st.SearchStrategy[str]:
    """Mostly well-shaped values (so validation past the first check runs), often hostile."""
    return st.one_of(
        st.sampled_from(seeds),
        IDENTIFIERS,
        st.sampled_from(HOSTILE_STRINGS),
        st.text(max_size=40),
        st.text(st.characters(codec="ascii"), max_size=60),
    )


_INTEGERS = (
    FieldDescriptor.TYPE_INT32,
    FieldDescriptor.TYPE_SINT32,
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_SINT64,
)


class Generator:
    """Strategies for every message type a request can carry, built once per type."""

    def __init__(self, seeds: tuple[str, ...], *, hostile: bool) -> None:
        self.hostile = hostile
        # Well-shaped requests carry real ids, known words and plain identifiers, so they get
        # past validation to the services behind (where other tenants' ids are the hostility).
        plain = st.one_of(
            st.sampled_from(seeds), st.from_regex(r"[a-z][a-z0-9-]{0,11}", fullmatch=True)
        )
        self.strings = strings(seeds) if hostile else plain
        scalars = st.one_of(st.none(), st.booleans(), st.integers(-9, 9), self.strings)
        self._struct = st.dictionaries(self.strings, scalars, max_size=6)
        self._messages: dict[str, st.SearchStrategy[Message]] = {}

    def value(self, field: Any) -> st.SearchStrategy[Any]:
        """Values for one field, whatever its type."""
        kind = field.type
        if kind == FieldDescriptor.TYPE_STRING:
            return self.strings
        if kind == FieldDescriptor.TYPE_BOOL:
            return st.booleans()
        if kind == FieldDescriptor.TYPE_ENUM:
            known = st.sampled_from([v.number for v in field.enum_type.values])
            return st.integers(-3, 20) if self.hostile else known
        if not self.hostile and kind in _INTEGERS:
            return st.integers(0, 300)
        if kind in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32):
            return st.one_of(st.integers(-5, 300), st.integers(-(2**31), 2**31 - 1))
        if kind in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64):
            return st.one_of(st.integers(-5, 50), st.integers(-(2**63), 2**63 - 1))
        if kind == FieldDescriptor.TYPE_MESSAGE:
            if field.message_type.full_name == "google.protobuf.Struct":
                return self._struct
            return self.messages(field.message_type)
        return st.nothing()

    def messages(self, descriptor: Any) -> st.SearchStrategy[Message]:
        """Messages of the type with any subset of fields set (one member per oneof)."""
        if descriptor.full_name not in self._messages:
            self._messages[descriptor.full_name] = self._build(descriptor)
        return self._messages[descriptor.full_name]

    def _build(self, descriptor: Any) -> st.SearchStrategy[Message]:
        cls = GetMessageClass(descriptor)
        setters = {f.name: self._setter(f) for f in descriptor.fields}
        oneofs = {
            o.name: st.sampled_from([None, *[f.name for f in o.fields]]) for o in descriptor.oneofs
        }

        @st.composite
        def build(draw: st.DrawFn) -> Message:
            message = cls()
            chosen = {name: draw(strategy) for name, strategy in oneofs.items()}
            for field in descriptor.fields:
                oneof = field.containing_oneof
                if oneof is not None and chosen[oneof.name] != field.name:
                    continue
                if oneof is None and not draw(st.integers(0, 3)):
                    continue  # a quarter of the fields left unset
                setters[field.name](draw, message)
            return message

        return build()

    def _setter(self, field: Any) -> Any:
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            items = st.lists(
                st.tuples(self.strings, self.value(entry.fields_by_name["value"])), max_size=4
            )

            def set_map(draw: st.DrawFn, message: Any) -> None:
                for key, item in draw(items):
                    getattr(message, field.name)[key].CopyFrom(item)

            return set_map
        if field.is_repeated:
            values = st.lists(self.value(field), max_size=20)

            def set_repeated(draw: st.DrawFn, message: Any) -> None:
                target = getattr(message, field.name)
                for item in draw(values):
                    if field.type == FieldDescriptor.TYPE_MESSAGE:
                        target.add().CopyFrom(item)
                    else:
                        target.append(item)

            return set_repeated
        one = self.value(field)

        def set_one(draw: st.DrawFn, message: Any) -> None:
            value = draw(one)
            if field.type != FieldDescriptor.TYPE_MESSAGE:
                setattr(message, field.name, value)
            elif isinstance(value, dict):
                getattr(message, field.name).update(value)
            else:
                getattr(message, field.name).CopyFrom(value)

        return set_one
