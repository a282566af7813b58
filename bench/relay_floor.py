"""The floor under an admission through the gateway: a call that does nothing through the same
two hops, each its own process on loopback as the gateway and admission are. A client calls
the relay, the relay calls the backend, the backend echoes the request's bytes; bare grpc.aio
(no interceptors, no protobuf: the bytes are the messages), on the loop the services run on.

`python -m bench.relay_floor backend` or `python -m bench.relay_floor relay BACKEND_ADDR`
prints `listening PORT` once it serves, and serves until SIGTERM.
"""

from __future__ import annotations

import sys

import grpc

from tether.runtime.process import run, wait_for_signal

SERVICE = "floor.Relay"
METHOD = f"/{SERVICE}/Call"


async def _serve(backend: str | None) -> None:
    server = grpc.aio.server()
    channel = grpc.aio.insecure_channel(backend) if backend else None
    forward = channel.unary_unary(METHOD) if channel else None

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    async def relay(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        assert forward is not None
        response: bytes = await forward(request)
        return response

    handler = grpc.unary_unary_rpc_method_handler(relay if forward else echo)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {"Call": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"listening {port}", flush=True)
    try:
        await wait_for_signal()
    finally:
        await server.stop(0)
        if channel is not None:
            await channel.close()


if __name__ == "__main__":
    role = sys.argv[1]
    if role not in ("backend", "relay"):
        sys.exit("usage: python -m bench.relay_floor backend | relay BACKEND_ADDR")
    run(_serve(sys.argv[2] if role == "relay" else None))
