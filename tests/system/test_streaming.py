"""StreamRun and StreamConversation with the services as processes: reconnects lose nothing,
Redis can vanish mid-stream, slow clients hold nobody up, and auth answers as documented.

The module's stack has its own Redis, so the tests can flush it, kill its clients and restart
it without touching the session's.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import redis.asyncio as redis

from tests.system.execution_support import ExecStack, exec_stack, run_row, wait_for_status
from tests.system.streaming_support import (
    Stream,
    as_json,
    get_run,
    key_with,
    metadata,
    prompt,
    read_run,
    transcript,
    until,
)
from tether.client import TetherClient
from tether.stack.embedded import EmbeddedRedis
from tether.testing.eventually import eventually
from tether.testing.model_server import ErrorTurn, TextTurn, ToolUseTurn
from tether.transport import RESUME_SEQ_KEY, TERMINAL_TYPES
from tether.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

# processes killed and restarted, services outlived: seconds each, so in `make slow` (the budget)
pytestmark = pytest.mark.slow


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def redis_server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[EmbeddedRedis]:
    server = EmbeddedRedis(Path(tmp_path_factory.mktemp("stream-redis")))
    await server.start()
    yield server
    server.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str,
    template_db: str,
    redis_server: EmbeddedRedis,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[ExecStack]:
    async with exec_stack(
        pg_server_url,
        template_db,
        redis_server.url,
        Path(tmp_path_factory.mktemp("stream")),
        workers=1,
        extra_env={
            "TETHER_GATEWAY_KEEPALIVE_INTERVAL_S": "0.3",
            "TETHER_GATEWAY_POLL_INTERVAL_S": "0.1",
            "TETHER_GATEWAY_CONVERSATION_POLL_S": "0.2",
            # Tiny pages: every catch-up reads several, through the read-ahead.
            "TETHER_GATEWAY_STREAM_PAGE_SIZE": "7",
        },
    ) as running:
        yield running


async def test_a_stream_sends_the_snapshot_then_every_event_and_ends(stack: ExecStack) -> None:
    tenant = await stack.tenant()
    text = prompt("simple")
    stack.model.script(
        text,
        [ToolUseTurn("get_time", {}, text="Checking."), TextTurn("Done.", chunks=["Do", "ne."])],
    )
    run_id = await tenant.send(text)
    stream = await read_run(tenant, run_id, include_deltas=True)
    final = await get_run(tenant, run_id)
    assert len(stream.snapshots) == 1
    assert stream.seqs == list(range(1, final.run.last_seq + 1))
    assert stream.durable[-1].type == "run.completed"
    assert transcript(stream.durable) == as_json(final.parts)
    again = await read_run(tenant, run_id, after_seq=3)
    assert again.seqs == list(range(4, final.run.last_seq + 1))
    assert as_json(again.snapshots[0].parts) == as_json(final.parts)
    batched = await read_run(tenant, run_id, after_seq=2, batch_catch_up=True)
    assert batched.seqs == list(range(3, final.run.last_seq + 1))


async def test_refresh_at_100_random_points_loses_nothing(stack: ExecStack) -> None:
    tenant = await stack.tenant()
    text = prompt("refresh")
    words = [f"r{i} " for i in range(600)]
    stack.model.script(
        text,
        [
            ErrorTurn(529),
            ToolUseTurn("get_time", {}, text="Let me check."),
            TextTurn("".join(words), chunks=words, delay_ms=10),
        ],
    )
    run_id = await tenant.send(text)
    rng = random.Random(20240605)
    stream = Stream()
    disconnects = 0
    async with grpc.aio.insecure_channel(stack.addr("gateway")) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        while not stream.ended:
            budget = rng.randint(1, 6) if disconnects < 100 else None
            call = stub.StreamRun(
                gateway_pb2.StreamRunRequest(
                    run_id=run_id, after_seq=stream.cursor, include_deltas=True
                ),
                metadata=tenant.metadata,
            )
            received = 0
            async for response in call:
                stream.take(response)
                received += 1
                if budget is not None and received >= budget and not stream.ended:
                    call.cancel()
                    disconnects += 1
                    break
    final = await get_run(tenant, run_id)
    assert disconnects == 100, "every disconnect happened before the run ended"
    assert stream.seqs == list(range(1, final.run.last_seq + 1)), "no duplicate, no gap"
    assert transcript(stream.durable) == as_json(final.parts)
    types = [e.type for e in stream.durable]
    for expected in ("run.retry-pending", "tool.started", "tool.completed", "run.completed"):
        assert expected in types
    assert any(e.type == "text.delta" for e in stream.events), "live deltas were delivered"


def long_text(label: str, words: int, delay_ms: float, width: int = 1) -> TextTurn:
    """A text answer streamed slowly, `words` chunks of about `width` characters each."""
    chunks = [f"{label}{i}".ljust(width) + " " for i in range(words)]
    return TextTurn("".join(chunks), chunks=chunks, delay_ms=delay_ms)


async def follow_all(
    tenant_key: str, gateway: str, run_id: str, streams: list[Stream], *, deltas: bool = False
) -> None:
    """Read one StreamRun per entry of `streams`, concurrently, each to its end."""

    async def one(stream: Stream, channel: grpc.aio.Channel) -> None:
        call = gateway_pb2_grpc.GatewayServiceStub(channel).StreamRun(
            gateway_pb2.StreamRunRequest(run_id=run_id, include_deltas=deltas),
            metadata=metadata(tenant_key),
        )
        async for response in call:
            stream.take(response)

    channels = [grpc.aio.insecure_channel(gateway) for _ in range(min(len(streams), 10))]
    try:
        await asyncio.gather(
            *(one(stream, channels[i % len(channels)]) for i, stream in enumerate(streams))
        )
    finally:
        for channel in channels:
            await channel.close()


async def test_redis_flushed_and_its_subscribers_killed_mid_stream_lose_nothing(
    stack: ExecStack, redis_server: EmbeddedRedis
) -> None:
    tenant = await stack.tenant()
    text = prompt("flush")
    stack.model.script(
        text, [ToolUseTurn("get_time", {}, text="One moment."), long_text("f", 300, 8)]
    )
    run_id = await tenant.send(text)
    streams = [Stream() for _ in range(5)]
    readers = asyncio.ensure_future(
        follow_all(tenant.api_key, stack.addr("gateway"), run_id, streams, deltas=True)
    )
    admin = redis.Redis.from_url(redis_server.url)
    try:
        for round_ in range(1, 6):
            # Let every subscriber see live progress, then take Redis's messages away.
            await until(
                lambda round_=round_: all(len(s.events) >= 8 * round_ for s in streams),
                what="live progress on every subscriber",
            )

            # The gateway re-subscribes after each kill; catch-up from PostgreSQL may have
            # delivered this round's progress before it did, and a subscriber seen a moment
            # ago may be between connections now: flush and kill once one is there to kill.
            async def flush_and_kill() -> int | None:
                await admin.flushall()
                return await admin.client_kill_filter(_type="pubsub") or None

            await eventually(flush_and_kill, what="a subscriber (the gateway's) to kill")
        await asyncio.wait_for(readers, 30)
    finally:
        await admin.aclose()
        readers.cancel()
    final = await get_run(tenant, run_id)
    assert final.run.status == common_pb2.RUN_STATUS_COMPLETED
    for stream in streams:
        assert stream.seqs == list(range(1, final.run.last_seq + 1))
        assert transcript(stream.durable) == as_json(final.parts)


async def test_streams_catch_up_from_postgres_while_redis_is_down(
    stack: ExecStack, redis_server: EmbeddedRedis
) -> None:
    tenant = await stack.tenant()
    text = prompt("outage")
    stack.model.script(text, [ToolUseTurn("get_time", {}), long_text("o", 200, 10)])
    run_id = await tenant.send(text)
    streams = [Stream() for _ in range(3)]
    readers = asyncio.ensure_future(
        follow_all(tenant.api_key, stack.addr("gateway"), run_id, streams)
    )
    try:
        await until(lambda: all(s.seqs for s in streams), what="every stream to start")
        redis_server.stop()
        try:
            row = await run_row(stack.db_url, run_id)
            target = row.last_seq + 3

            # Events committed while Redis is down reach every stream by polling.
            await until(
                lambda: all(s.cursor >= target for s in streams),
                timeout=20,
                what="catch-up by polling",
            )
        finally:
            await redis_server.start()
        await asyncio.wait_for(readers, 30)
    finally:
        readers.cancel()
    final = await get_run(tenant, run_id)
    for stream in streams:
        assert stream.seqs == list(range(1, final.run.last_seq + 1))


async def test_a_slow_subscriber_is_cut_with_a_cursor_and_delays_no_one(stack: ExecStack) -> None:
    gateway = await stack.services.start(
        "gateway", extra_env={"TETHER_GATEWAY_STREAM_BUFFER": "16"}
    )
    tenant = await stack.tenant()
    text = prompt("slow reader")
    stack.model.script(text, [long_text("s", 200, 4, width=2000)])
    run_id = await tenant.send(text)
    request = gateway_pb2.StreamRunRequest(run_id=run_id, include_deltas=True)
    # Without BDP probing the receive window stays at its initial 64 KiB: a client that stops
    # reading is stalled after that much, as a slow network or a busy browser would be.
    slow_channel = grpc.aio.insecure_channel(gateway.address, options=[("grpc.http2.bdp_probe", 0)])
    try:
        slow = gateway_pb2_grpc.GatewayServiceStub(slow_channel).StreamRun(
            request, metadata=tenant.metadata
        )
        first = await slow.read()  # the snapshot; then this client stops reading
        assert first.HasField("snapshot")
        fast = Stream()
        async with grpc.aio.insecure_channel(gateway.address) as channel:
            async for response in gateway_pb2_grpc.GatewayServiceStub(channel).StreamRun(
                request, metadata=tenant.metadata
            ):
                fast.take(response)
        # The fast subscriber heard the whole run while the slow one had read nothing past its
        # snapshot: a fan-out that waited on the slow one would never have let it finish.
        final = await get_run(tenant, run_id)
        assert fast.seqs == list(range(1, final.run.last_seq + 1))

        slow_stream = Stream()
        with pytest.raises(grpc.aio.AioRpcError) as cut:
            while True:
                response = await slow.read()
                assert response is not grpc.aio.EOF, "the slow subscriber was not cut"
                slow_stream.take(response)
        assert cut.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        resume = dict(cut.value.trailing_metadata() or ())[RESUME_SEQ_KEY]
        assert int(resume) == slow_stream.cursor
        rest = await read_run(tenant, run_id, after_seq=int(resume))
        assert slow_stream.seqs + rest.seqs == list(range(1, final.run.last_seq + 1))
    finally:
        await slow_channel.close()
        await stack.services.stop(gateway.name)


@pytest.mark.slow  # 500 streams at once
async def test_500_concurrent_subscribers_on_one_run_each_receive_every_event(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant()
    conversation = f"crowd-{random.randrange(10**9)}"
    blocker, text = prompt("blocker"), prompt("crowd")
    stack.model.script(blocker, [long_text("b", 3000, 10)])
    stack.model.script(text, [ToolUseTurn("get_time", {}, text="Checking."), long_text("c", 40, 5)])
    blocking = await tenant.send(blocker, conversation)
    await wait_for_status(stack.db_url, blocking, "running")
    run_id = await tenant.send(text, conversation)  # queued behind the blocker
    streams = [Stream() for _ in range(500)]
    readers = asyncio.ensure_future(
        follow_all(tenant.api_key, stack.addr("gateway"), run_id, streams)
    )
    try:
        await until(lambda: all(s.snapshots for s in streams), timeout=30, what="500 streams")
        assert (await run_row(stack.db_url, run_id)).status == "queued"
        await tenant.cancel(blocking)  # now the run starts, with everyone listening
        await asyncio.wait_for(readers, 60)
    finally:
        readers.cancel()
    final = await get_run(tenant, run_id)
    expected = list(range(1, final.run.last_seq + 1))
    assert final.run.status == common_pb2.RUN_STATUS_COMPLETED
    assert all(stream.seqs == expected for stream in streams)


async def test_a_paused_run_streams_keepalives_with_its_status(stack: ExecStack) -> None:
    tenant = await stack.tenant()
    text = prompt("pause")
    stack.model.script(text, [ErrorTurn(429, retry_after_ms=1500), TextTurn("back")])
    run_id = await tenant.send(text)
    stream = await read_run(tenant, run_id)
    statuses = [e.keepalive.status for e in stream.events if e.type == "keepalive"]
    assert common_pb2.RUN_STATUS_RETRY_PENDING in statuses
    assert all(e.seq == 0 for e in stream.events if e.type == "keepalive")
    assert stream.durable[-1].type == "run.completed"


async def test_the_python_client_rides_out_a_gateway_restart(stack: ExecStack) -> None:
    gateway = await stack.services.start("gateway")
    tenant = await stack.tenant()
    text = prompt("restart")
    stack.model.script(text, [ToolUseTurn("get_time", {}), long_text("g", 300, 8)])
    run_id = await tenant.send(text)
    stream = Stream()
    async with TetherClient(gateway.address, tenant.api_key) as client:
        watch = client.watch(run_id, include_deltas=True)

        async def consume() -> None:
            async for item in watch:
                stream.take(item)

        consumer = asyncio.ensure_future(consume())
        try:
            await until(lambda: len(stream.seqs) >= 3, what="the watch to start")
            started = time.monotonic()
            assert await stack.services.stop(gateway.name, grace=15) == 0
            assert time.monotonic() - started < 3, "open streams did not hold up the shutdown"
            await stack.services.start(
                "gateway", extra_env={"TETHER_GATEWAY_PORT": str(gateway.port)}
            )
            await asyncio.wait_for(consumer, 30)
        finally:
            consumer.cancel()
            await stack.services.stop(gateway.name)
    final = await get_run(tenant, run_id)
    assert watch.reconnects >= 1
    assert stream.seqs == list(range(1, final.run.last_seq + 1))
    assert transcript(stream.durable) == as_json(final.parts)
    assert len(stream.snapshots) == 2, "one snapshot per connection that got through"


async def test_a_conversation_stream_covers_every_run_and_resumes_from_its_cursor(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant()
    conversation = f"conv-{random.randrange(10**9)}"
    first, second, third = prompt("one"), prompt("two"), prompt("three")
    stack.model.script(first, [TextTurn("first answer")])
    stack.model.script(second, [ToolUseTurn("get_time", {}), long_text("t", 40, 5)])
    stack.model.script(third, [TextTurn("third answer")])
    run_ids = [await tenant.send(first, conversation), await tenant.send(second, conversation)]
    events: list[tuple[str, int]] = []
    cursor = ""
    ended: set[str] = set()
    connections = 0
    async with grpc.aio.insecure_channel(stack.addr("gateway")) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        while len(ended) < 3:
            connections += 1
            call = stub.StreamConversation(
                gateway_pb2.StreamConversationRequest(conversation_id=conversation, cursor=cursor),
                metadata=tenant.metadata,
            )
            received = 0
            async for response in call:
                cursor = response.cursor
                event = response.event
                if event.seq:
                    events.append((event.run_id, event.seq))
                    received += 1
                if event.type in TERMINAL_TYPES:
                    ended.add(event.run_id)
                    if len(run_ids) == 2:
                        # A run that starts while the stream is open is found too.
                        run_ids.append(await tenant.send(third, conversation))
                if len(ended) == 3 or (connections < 6 and received >= 4):
                    call.cancel()
                    break
    assert set(ended) == set(run_ids)
    assert len(events) == len(set(events)), "no duplicate"
    for run_id in run_ids:
        final = await get_run(tenant, run_id)
        seqs = [seq for rid, seq in events if rid == run_id]
        assert seqs == list(range(1, final.run.last_seq + 1)), run_id


async def test_every_auth_failure_has_its_status(stack: ExecStack) -> None:
    owner, stranger = await stack.tenant(), await stack.tenant()
    text = prompt("private")
    stack.model.script(text, [TextTurn("secret")])
    run_id = await owner.send(text)
    write_only = await key_with(stack, owner.tenant_id, ["runs:write"])
    absent = "run_" + "0" * 32

    async def refusal(
        call: grpc.aio.UnaryStreamCall,
    ) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
        return info.value

    async with grpc.aio.insecure_channel(stack.addr("gateway")) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        run = gateway_pb2.StreamRunRequest(run_id=run_id)
        conversation = gateway_pb2.StreamConversationRequest(conversation_id="c")
        for open_stream, request in (
            (stub.StreamRun, run),
            (stub.StreamConversation, conversation),
        ):
            none = await refusal(open_stream(request))
            forged = await refusal(open_stream(request, metadata=metadata("tk_forged")))
            scope = await refusal(open_stream(request, metadata=metadata(write_only)))
            assert none.code() == forged.code() == grpc.StatusCode.UNAUTHENTICATED
            assert scope.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "runs:read" in (scope.details() or "")
        theirs = await refusal(stub.StreamRun(run, metadata=metadata(stranger.api_key)))
        missing = await refusal(
            stub.StreamRun(
                gateway_pb2.StreamRunRequest(run_id=absent), metadata=metadata(stranger.api_key)
            )
        )
    assert theirs.code() == missing.code() == grpc.StatusCode.NOT_FOUND
    assert (theirs.details() or "").replace(run_id, "ID") == (missing.details() or "").replace(
        absent, "ID"
    )
    assert theirs.trailing_metadata() == missing.trailing_metadata()
