"""Support for the streaming tests: reading streams, assembling transcripts, keys with scopes."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import json_format

from tests.system.execution_support import ExecStack, Tenant
from tether import apikeys
from tether.db.engine import create_engine
from tether.testing.eventually import eventually
from tether.transport import TERMINAL_TYPES, apply_part_event
from tether.v1 import common_pb2, events_pb2, gateway_pb2, gateway_pb2_grpc


async def until(condition: Callable[[], bool], *, what: str, timeout: float = 10.0) -> None:
    """Wait until a condition over in-process state holds (polled, never a bare sleep)."""

    async def probe() -> bool:
        return condition()

    await eventually(probe, timeout=timeout, what=what)


def prompt(label: str) -> str:
    """A unique first message: the model server's script key."""
    return f"{label} {uuid.uuid4().hex}"


def metadata(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


async def key_with(stack: ExecStack, tenant_id: str, scopes: Sequence[str]) -> str:
    """Another key of the tenant, with exactly `scopes`."""
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.begin() as conn:
            key, _ = await apikeys.create_key(conn, tenant_id, "scoped", list(scopes))
    finally:
        await engine.dispose()
    return key


@dataclass
class Stream:
    """What one or more connections of a run stream delivered."""

    snapshots: list[gateway_pb2.RunSnapshot] = field(default_factory=list)
    events: list[events_pb2.RunEvent] = field(default_factory=list)

    @property
    def durable(self) -> list[events_pb2.RunEvent]:
        return [e for e in self.events if e.seq]

    @property
    def seqs(self) -> list[int]:
        return [e.seq for e in self.durable]

    @property
    def cursor(self) -> int:
        return max(self.seqs, default=0)

    @property
    def ended(self) -> bool:
        return any(e.type in TERMINAL_TYPES for e in self.durable)

    def take(self, response: gateway_pb2.StreamRunResponse) -> None:
        kind = response.WhichOneof("item")
        if kind == "snapshot":
            self.snapshots.append(response.snapshot)
        elif kind == "batch":
            self.events.extend(response.batch.events)
        else:
            self.events.append(response.event)


def transcript(events: Sequence[events_pb2.RunEvent]) -> list[dict[str, Any]]:
    """The parts that part.added / part.updated events build, as JSON, in index order."""
    parts: dict[int, common_pb2.Part] = {}
    for event in events:
        apply_part_event(parts, event)
    return [json_format.MessageToDict(parts[i]) for i in sorted(parts)]


def as_json(parts: Sequence[common_pb2.Part]) -> list[dict[str, Any]]:
    return [json_format.MessageToDict(p) for p in parts]


async def read_run(
    tenant: Tenant,
    run_id: str,
    *,
    after_seq: int = 0,
    include_deltas: bool = False,
    batch_catch_up: bool = False,
    key: str | None = None,
) -> Stream:
    """One connection read to its end (a terminal event)."""
    stream = Stream()
    async with grpc.aio.insecure_channel(tenant.stack.addr("gateway")) as channel:
        call = gateway_pb2_grpc.GatewayServiceStub(channel).StreamRun(
            gateway_pb2.StreamRunRequest(
                run_id=run_id,
                after_seq=after_seq,
                include_deltas=include_deltas,
                batch_catch_up=batch_catch_up,
            ),
            metadata=metadata(key or tenant.api_key),
        )
        async for response in call:
            stream.take(response)
    return stream


async def get_run(tenant: Tenant, run_id: str) -> gateway_pb2.GetRunResponse:
    async with grpc.aio.insecure_channel(tenant.stack.addr("gateway")) as channel:
        response: gateway_pb2.GetRunResponse = await gateway_pb2_grpc.GatewayServiceStub(
            channel
        ).GetRun(gateway_pb2.GetRunRequest(run_id=run_id), metadata=tenant.metadata)
    return response
