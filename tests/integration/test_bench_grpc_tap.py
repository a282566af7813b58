"""The hot-path bench's gRPC tap against a real grpc.aio server: every call and message is
counted under its method, with a dynamic HPACK table that fills and evicts."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest_asyncio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from bench.grpc_tap import UNKNOWN, Tap, streaming

# Long method names: their :path entries (about 140 bytes each) fill HPACK's 4 KiB dynamic table
# many times over, so a decoder that evicts other than the encoder does misreads the indexed
# headers (:authority, content-type, ...) that every later call refers to.
METHODS = [f"Call{i:03d}" + "x" * 100 for i in range(120)]


@pytest_asyncio.fixture(loop_scope="session")
async def tapped() -> AsyncIterator[tuple[Tap, health.aio.HealthServicer]]:
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "test.Echo", {m: grpc.unary_unary_rpc_method_handler(echo) for m in METHODS}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    tap = Tap(f"127.0.0.1:{port}")
    await tap.start()
    try:
        yield tap, servicer
    finally:
        await tap.close()
        await server.stop(None)


async def test_unary_calls_and_stream_messages_are_counted_by_method(
    tapped: tuple[Tap, health.aio.HealthServicer],
) -> None:
    tap, servicer = tapped
    async with grpc.aio.insecure_channel(tap.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for _ in range(5):
            await stub.Check(health_pb2.HealthCheckRequest(), metadata=(("x-note", "n"),))
        watch = stub.Watch(health_pb2.HealthCheckRequest(service="watched"))
        statuses = []
        async for response in watch:
            statuses.append(response.status)
            if len(statuses) == 1:
                await servicer.set("watched", health_pb2.HealthCheckResponse.SERVING)
            elif len(statuses) == 2:
                await servicer.set("watched", health_pb2.HealthCheckResponse.NOT_SERVING)
            else:
                break
        watch.cancel()
        for round_ in range(2):
            for method in METHODS:
                payload = b"p" * (70_000 if method == METHODS[7] else round_)  # several frames
                assert await channel.unary_unary(f"/test.Echo/{method}")(payload) == payload

    counts = tap.counts
    check, watched = "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"
    assert counts.calls[check] == counts.requests[check] == counts.responses[check] == 5
    assert (counts.calls[watched], counts.requests[watched], counts.responses[watched]) == (1, 1, 3)
    for method in METHODS:
        path = f"/test.Echo/{method}"
        assert counts.calls[path] == counts.requests[path] == counts.responses[path] == 2
    assert counts.calls[UNKNOWN] == 0
    units = counts.units()
    assert units[check] == 5  # unary: once per call
    assert units[watched] == 4  # streaming: every message, the request included


def test_streaming_methods_are_known_from_the_descriptors() -> None:
    assert streaming("/tether.v1.GatewayService/StreamRun")
    assert not streaming("/tether.v1.GatewayService/SendMessage")
    assert not streaming("/test.Echo/Unknown")
