"""Forwarding to internal services: their failures become the same TetherError here."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

import grpc

from tether.errors import from_rpc_error

T = TypeVar("T")


async def forward(call: Awaitable[T]) -> T:
    """Await an internal call, translating its failure into the same TetherError."""
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        raise from_rpc_error(exc) from exc
