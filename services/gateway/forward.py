"""Forwarding to internal services: their failures become the same TetherError here."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Literal, TypeVar

import grpc

from tether.errors import from_rpc_error

T = TypeVar("T")

Hop = Literal["admission", "orchestrator", "interactions"]


async def forward(call: Awaitable[T], hop: Hop) -> T:
    """Await a call to the internal service `hop`, translating its failure into the same
    TetherError; the service being unreachable is UNAVAILABLE naming it."""
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        raise from_rpc_error(exc, hop) from exc
