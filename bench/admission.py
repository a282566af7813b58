"""Admission figures: admissions/s and p50/p99 latency at 1, 16 and 64 concurrent callers,
for unique and duplicate deliveries, through the gateway and directly to admission."""

from __future__ import annotations

import uuid

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.common import BenchStack, bench_stack, closed_loop, emit
from tether.runtime.rpc import internal_channel
from tether.v1 import admission_pb2, admission_pb2_grpc, gateway_pb2, gateway_pb2_grpc

CALLERS = (1, 16, 64)
OPS_TOTAL = 1600  # per configuration: enough for a stable p99 in a few seconds


async def _measure(stack: BenchStack, path: str, delivery: str, callers: int) -> None:
    run_tag = uuid.uuid4().hex[:8]
    per_caller = max(OPS_TOTAL // callers, 20)
    if path == "gateway":
        channel = grpc.aio.insecure_channel(stack.services.addresses()["gateway"])
        gateway = gateway_pb2_grpc.GatewayServiceStub(channel)
        meta = (("authorization", f"Bearer {stack.api_key}"),)

        async def send(event_id: str, conversation: str) -> None:
            await gateway.SendMessage(
                gateway_pb2.SendMessageRequest(
                    event_id=event_id, conversation_id=conversation, text="bench message"
                ),
                metadata=meta,
            )
    else:
        channel = internal_channel(
            stack.services.addresses()["admission"], stack.credentials["gateway"]
        )
        admission = admission_pb2_grpc.AdmissionServiceStub(channel)
        caller = admission_pb2.Caller(tenant_id="bench", principal_id="bench")

        async def send(event_id: str, conversation: str) -> None:
            await admission.Admit(
                admission_pb2.AdmitRequest(
                    caller=caller,
                    chat=admission_pb2.ChatInput(
                        event_id=event_id, conversation_id=conversation, text="bench message"
                    ),
                )
            )

    if delivery == "duplicate":
        # Every caller re-delivers events that were admitted before the clock starts.
        for c in range(callers):
            for i in range(per_caller):
                await send(f"dup-{run_tag}-{c}-{i % 10}", f"conv-{run_tag}-{c}")

    async def op(c: int, i: int) -> None:
        suffix = i % 10 if delivery == "duplicate" else i
        prefix = "dup" if delivery == "duplicate" else "uniq"
        await send(f"{prefix}-{run_tag}-{c}-{suffix}", f"conv-{run_tag}-{c}")

    await closed_loop(op, callers=callers, ops_per_caller=min(per_caller, 20))  # warm-up
    result = await closed_loop(op, callers=callers, ops_per_caller=per_caller)
    await channel.close()
    name = "admit" if delivery == "unique" else "admit_dup"
    suffix = "" if path == "gateway" else "_direct"
    config = {"path": path, "delivery": delivery, "callers": callers, "ops": result.ops}
    emit(f"{name}_per_s_c{callers}{suffix}", result.per_s, "ops/s", **config)
    emit(f"{name}_p50_ms_c{callers}{suffix}", result.p50, "ms", **config)
    emit(f"{name}_p99_ms_c{callers}{suffix}", result.p99, "ms", **config)


async def _rpc_floor(stack: BenchStack, callers: int = 16) -> None:
    """The ceiling under every admission figure: a unary RPC that does no work (the health
    check of the admission service, through the same server and interceptors), at 16 callers.
    An admission through the gateway is two such hops plus its transaction."""
    channel = grpc.aio.insecure_channel(stack.services.addresses()["admission"])
    health = health_pb2_grpc.HealthStub(channel)

    async def op(c: int, i: int) -> None:
        await health.Check(health_pb2.HealthCheckRequest())

    await closed_loop(op, callers=callers, ops_per_caller=20)  # warm-up
    result = await closed_loop(op, callers=callers, ops_per_caller=OPS_TOTAL // callers * 2)
    await channel.close()
    config = {"rpc": "grpc.health.v1.Health/Check", "callers": callers, "ops": result.ops}
    emit(f"rpc_floor_per_s_c{callers}", result.per_s, "ops/s", **config)
    emit(f"rpc_floor_p50_ms_c{callers}", result.p50, "ms", **config)
    emit(f"rpc_floor_p99_ms_c{callers}", result.p99, "ms", **config)


async def run() -> None:
    """Run the admission group."""
    async with bench_stack() as stack:
        await _rpc_floor(stack)
        for path in ("gateway", "direct"):
            for delivery in ("unique", "duplicate"):
                for callers in CALLERS:
                    await _measure(stack, path, delivery, callers)
