"""The floor of Tether's topology: the same processes and hops a run crosses, each doing only
what its hop needs, with none of the runtime's own work (no validation, dedup, sessions, parts,
events, routing, history, usage, protobuf messages or SQLAlchemy).

Per run: the load generator calls the edge (the gateway's place) and the edge calls the intake
(admission's), both unary; the intake inserts the run (one single-row autocommit insert) and
publishes a wake-up on Redis; the dispatcher (the orchestrator's place), subscribed, claims it
(one single-row update, FOR UPDATE SKIP LOCKED) and pushes it on a runner's long-lived stream;
the runner (a worker's) makes the same streamed SDK call the run floor makes and sends its
completion on the stream; the dispatcher marks it done (one single-row update), acknowledges
it (the slot comes back with the acknowledgement) and publishes the ending on Redis, where the
load generator, subscribed, sees it. Bare grpc.aio (bytes are the messages), redis.asyncio and
asyncpg, on the loop the services run on.

With `records`, the intake sends admission's own statement instead of its one-row insert (the
claim, session, message, run and its event, in one round trip on a bare driver connection):
what admission's records cost on the way in, still with none of the services' code.

`python -m bench.topology_floor ROLE ...` (see `main`) prints `listening PORT` (servers) or
`ready` once it serves, and runs until SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg
import grpc
import redis.asyncio as redis
from anthropic import AsyncAnthropic
from sqlalchemy.dialects.postgresql.asyncpg import PGDialect_asyncpg

from bench.model import BENCH_REQUEST, MODEL, streamed_call
from services.admission import repository
from services.admission.adapters import normalise
from services.admission.domain import InboundEvent
from services.orchestrator import claims, routing
from services.orchestrator.repositories import completion, leases
from tether.db.direct import Direct
from tether.domain import Batch, Completed, ModelTurn, Part, Role, Text, part_added, usage_updated
from tether.runtime.process import run, wait_for_signal
from tether.testing.demo_agent import demo_turn
from tether.testing.model_cache import input_tokens_for
from tether.testing.model_script import TextTurn
from tether.v1 import admission_pb2

SERVICE = "floor.Topology"
SEND, ADMIT, WORK = f"/{SERVICE}/Send", f"/{SERVICE}/Admit", f"/{SERVICE}/Work"
WAKE, DONE = "topology-floor:wake", "topology-floor:done"
TABLE = "topology_floor_runs"
CREATE = (
    f"CREATE TABLE IF NOT EXISTS {TABLE} (id bigserial PRIMARY KEY, "
    "status text NOT NULL DEFAULT 'queued', at timestamptz NOT NULL DEFAULT now())"
)
INSERT = f"INSERT INTO {TABLE} DEFAULT VALUES RETURNING id"
CLAIM = (
    f"UPDATE {TABLE} SET status = 'running' WHERE id = (SELECT id FROM {TABLE} "
    "WHERE status = 'queued' ORDER BY id FOR UPDATE SKIP LOCKED LIMIT 1) RETURNING id"
)
COMPLETE = f"UPDATE {TABLE} SET status = 'completed' WHERE id = $1"
EACH_RUN = (
    "load -> edge -> intake, unary; 1 insert + 1 publish; the dispatcher, woken through Redis, "
    "1 claim update, the lease pushed on a runner's stream; 1 streamed SDK call; the completion "
    "on the stream, 1 update, the acknowledgement back, 1 publish the load generator hears"
)


async def _server(methods: dict[str, grpc.RpcMethodHandler]) -> grpc.aio.Server:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, methods),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"listening {port}", flush=True)
    return server


async def edge(intake: str) -> None:
    """The gateway's place: forwards each call to the intake."""
    async with grpc.aio.insecure_channel(intake) as channel:
        admit = channel.unary_unary(ADMIT)

        async def send(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            answer: bytes = await admit(request)
            return answer

        server = await _server({"Send": grpc.unary_unary_rpc_method_handler(send)})
        await wait_for_signal()
        await server.stop(0)


async def intake(db_url: str, redis_url: str, records: bool = False) -> None:
    """Admission's place: one insert, one wake-up. With `records`, the insert is admission's
    own statement (every record it writes: claim, session, message, run, event), sent bare."""
    pool = await asyncpg.create_pool(db_url, min_size=4, max_size=10)
    bus = redis.Redis.from_url(redis_url)
    admitted = _admitted() if records else None

    async def admit(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if admitted is None:
            run_id = str(await pool.fetchval(INSERT))
        else:
            run_id = (await pool.fetchrow(*admitted()))["run_id"]
        await bus.publish(WAKE, run_id)
        return run_id.encode()

    server = await _server({"Admit": grpc.unary_unary_rpc_method_handler(admit)})
    await wait_for_signal()
    await server.stop(0)
    await bus.aclose()
    await pool.close()


def _event() -> InboundEvent:
    """A chat message to the bench tenant (bench.common.bench_database)."""
    return normalise(
        admission_pb2.AdmitRequest(
            caller=admission_pb2.Caller(tenant_id="bench", principal_id="bench"),
            chat=admission_pb2.ChatInput(event_id="e", conversation_id="c", text="bench"),
        )
    )


# A statement's SQL, then its arguments, for one call.
Arguments = Callable[[], list[Any]]


def _admitted() -> Arguments:
    """Admission's statement and, per call, its arguments for a new event in a new conversation
    of the bench tenant (bench.common.bench_database): the values the service would bind, from
    one template, with no request read and no service code around the statement."""
    event = _event()
    template = repository.admit_params(
        event=event,
        request_hash=event.request_hash(),
        run_id="",
        session_id="",
        message_id="",
        max_attempts=3,
        traceparent=None,
    )
    dialect, tag, sent = PGDialect_asyncpg(), f"floor-{os.getpid()}", itertools.count()

    def arguments() -> list[Any]:
        n = f"{tag}-{next(sent)}"
        unique = ("key", "event_id", "conversation_id", "run_id", "session_id", "message_id")
        return _sent(repository.ADMIT_NEW, dialect, {**template, **dict.fromkeys(unique, n)})

    return arguments


class _Kept:
    """The orchestrator's claim and completion for the bench tenant's runs, as the service
    binds them: the route its admissions take (tenant, source and channel of `_admitted`'s
    event), and a one-turn completion (the answer the local model gives the bench's request,
    its part, its usage and their events), each built once."""

    WORKER = "floor-runner"

    def __init__(self, agent: dict[str, Any]) -> None:
        event = _event()
        routed = claims.Routing(agent, routing.resolve(agent, event.source, event.channel))
        self._route = leases.Route(
            "bench",
            event.source,
            event.channel,
            agent,
            0,  # the bench tenant has no agents: its routing is resolved from tenants.agent
            routed.routing_id,
            routed.config.limits.max_attempts,
        )
        self._unstored = {routed.routing_id: routed.stored}  # stored by the first claim
        self._epochs: dict[str, int] = {}
        answer = demo_turn(BENCH_REQUEST)
        assert isinstance(answer, TextTurn), "the bench's request is answered in text"
        part = Part(0, Role.ASSISTANT, Text(answer.text), final=True)
        turn = ModelTurn(MODEL, input_tokens_for(BENCH_REQUEST), len(answer.text) // 4 + 1)
        self._ending = Completed(answer.text)
        self._done = {
            "in_flight": Batch(0),
            "parts": [part],
            "events": [part_added(part), usage_updated(turn, turn.tokens())],
            "turns": [turn],
            "stages": {"context_ms": 0.1, "attempt_ms": 1.0, "total_ms": 1.2},
            "audit": {"model": MODEL},
        }
        self._dialect = PGDialect_asyncpg()

    @classmethod
    async def of(cls, pool: asyncpg.Pool) -> _Kept:
        agent = await pool.fetchval("SELECT agent FROM tenants WHERE tenant_id = 'bench'")
        return cls(json.loads(agent))

    def claim(self, limit: int) -> list[Any]:
        params = leases.claim_params(
            worker_id=self.WORKER,
            limit=limit,
            ttl_s=60,
            routes=[self._route],
            stored=self._unstored,
        )
        self._unstored = {}
        return _sent(leases.CLAIM, self._dialect, params)

    def leased(self, rows: list[asyncpg.Record]) -> list[str]:
        """The runs the claim leased (each its epoch noted); every run it picked must be."""
        for row in rows:
            if row["run_id"] is None:
                raise RuntimeError(f"the claim did not lease {row['picked_run_id']}")
            self._epochs[row["run_id"]] = row["lease_epoch"]
        return [row["run_id"] for row in rows]

    def complete(self, run_id: str) -> list[Any]:
        epoch = self._epochs.pop(run_id)
        params = completion.complete_params(run_id, epoch, self._ending, **self._done)
        return _sent(completion.COMPLETE, self._dialect, params)


def _sent(statement: Direct, dialect: PGDialect_asyncpg, params: dict[str, Any]) -> list[Any]:
    sql, args = statement.bound(dialect, params)
    return [sql, *args]


class _Runner:
    """One runner's stream: its free slots and what goes out on it."""

    def __init__(self, credits: int) -> None:
        self.credits = credits
        self.outbox: asyncio.Queue[bytes] = asyncio.Queue()


async def dispatcher(db_url: str, redis_url: str, records: bool = False) -> None:
    """The orchestrator's place: woken through Redis, it claims and pushes; it completes,
    acknowledges (the slot comes back with it) and publishes the ending. With `records`, the
    claim and the completion are the orchestrator's own statements (lease, attempt, event;
    part, usage, events, session, attempt, audit), sent bare."""
    pool = await asyncpg.create_pool(db_url, min_size=4, max_size=10)
    bus = redis.Redis.from_url(redis_url)
    runners: list[_Runner] = []
    look = asyncio.Event()
    kept = await _Kept.of(pool) if records else None

    async def claim(limit: int) -> list[str]:
        if kept is None:
            run_id = await pool.fetchval(CLAIM)
            return [] if run_id is None else [str(run_id)]
        return kept.leased(await pool.fetch(*kept.claim(limit)))

    async def complete(run_id: str) -> None:
        if kept is None:
            await pool.execute(COMPLETE, int(run_id))
        elif await pool.fetchrow(*kept.complete(run_id)) is None:
            raise RuntimeError(f"the completion of {run_id} found its lease stale")

    # The last look came back short: nothing is queued until a wake-up says so, so a slot given
    # back alone needs no look (as the orchestrator's dispatcher: one claim per run, not more).
    drained = False

    async def dispatch() -> None:
        nonlocal drained
        while True:
            await look.wait()
            look.clear()
            for runner in runners:
                while runner.credits > 0 and not drained:
                    asked = runner.credits if kept is not None else 1
                    leased = await claim(asked)
                    runner.credits -= len(leased)
                    for run_id in leased:
                        runner.outbox.put_nowait(b"L" + run_id.encode())
                    drained = len(leased) < asked

    async def wakeups() -> None:
        nonlocal drained
        pubsub = bus.pubsub()
        await pubsub.subscribe(WAKE)
        async for message in pubsub.listen():
            if message["type"] == "message":
                drained = False
                look.set()

    async def work(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
        first = await anext(requests)
        runner = _Runner(int(first[1:]))
        runners.append(runner)
        look.set()

        async def read() -> None:
            async for message in requests:
                run_id = message[1:].decode()
                await complete(run_id)
                runner.credits += 1
                runner.outbox.put_nowait(b"A" + message[1:])
                await bus.publish(DONE, run_id)
                if not drained:
                    look.set()

        reader = asyncio.ensure_future(read())
        try:
            while True:
                yield await runner.outbox.get()
        finally:
            reader.cancel()
            runners.remove(runner)

    tasks = [asyncio.ensure_future(dispatch()), asyncio.ensure_future(wakeups())]
    server = await _server({"Work": grpc.stream_stream_rpc_method_handler(work)})
    await wait_for_signal()
    await server.stop(0)
    for task in tasks:
        task.cancel()
    await bus.aclose()
    await pool.close()


async def runner(dispatcher_addr: str, model_url: str, concurrency: int) -> None:
    """A worker's place: one stream; each pushed run is one streamed SDK call, then its
    completion."""
    sdk = AsyncAnthropic(base_url=model_url, api_key="bench", max_retries=0)
    outbox: asyncio.Queue[bytes] = asyncio.Queue()
    outbox.put_nowait(b"C" + str(concurrency).encode())
    running: set[asyncio.Task[None]] = set()

    async def requests() -> AsyncIterator[bytes]:
        while True:
            yield await outbox.get()

    async def attempt(run_id: bytes) -> None:
        await streamed_call(sdk, BENCH_REQUEST)
        outbox.put_nowait(b"D" + run_id)

    async with grpc.aio.insecure_channel(dispatcher_addr) as channel:
        call = channel.stream_stream(WORK)(requests())
        print("ready", flush=True)
        with contextlib.suppress(grpc.aio.AioRpcError):  # the dispatcher stopped first
            async for message in call:
                if message[:1] == b"L":
                    task = asyncio.ensure_future(attempt(message[1:]))
                    running.add(task)
                    task.add_done_callback(running.discard)
    await sdk.close()


async def prepare(db_url: str) -> None:
    """The floor's table, empty."""
    db = await asyncpg.connect(db_url)
    try:
        await db.execute(CREATE)
        await db.execute(f"TRUNCATE {TABLE}")
    finally:
        await db.close()


def main() -> None:
    """`edge INTAKE_ADDR` | `intake DB_URL REDIS_URL [records]` |
    `dispatcher DB_URL REDIS_URL [records]` | `runner DISPATCHER_ADDR MODEL_URL CONCURRENCY`."""
    role, args = sys.argv[1], sys.argv[2:]
    if role == "edge":
        run(edge(args[0]))
    elif role == "intake":
        run(intake(args[0], args[1], records=args[2:] == ["records"]))
    elif role == "dispatcher":
        run(dispatcher(args[0], args[1], records=args[2:] == ["records"]))
    elif role == "runner":
        run(runner(args[0], args[1], int(args[2])))
    else:
        sys.exit(main.__doc__)


if __name__ == "__main__":
    main()
