"""A tenant's settings: the platform operator's `SetTenant` (its weight in fair leases and its cap
on runs running at once), written where tenants live and audited in the same transaction. The
orchestrator reads them in every claim: a change holds from the next lease on."""

from __future__ import annotations

from typing import Any

import grpc
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncEngine

from services.gateway.grpc.callers import Callers
from tether import apikeys, audit
from tether.db.schema import tenants
from tether.errors import InvalidArgument, NotFound
from tether.v1 import gateway_pb2


def _changes(request: gateway_pb2.SetTenantRequest) -> dict[str, Any]:
    """The columns `request` sets; InvalidArgument for a weight below 1, a cap both set and
    cleared, or nothing to set."""
    changes: dict[str, Any] = {}
    if request.HasField("weight"):
        if request.weight < 1:
            raise InvalidArgument(f"weight must be at least 1; got {request.weight}")
        changes["weight"] = request.weight
    if request.clear_max_running:
        if request.HasField("max_running"):
            raise InvalidArgument("max_running and clear_max_running: name one")
        changes["max_running"] = None
    elif request.HasField("max_running"):
        changes["max_running"] = request.max_running
    if not changes:
        raise InvalidArgument("nothing to set: name weight, max_running or clear_max_running")
    return changes


class TenantSettingsRpcs:
    """Implements SetTenant of tether.v1.GatewayService."""

    def __init__(self, *, callers: Callers, engine: AsyncEngine) -> None:
        self._callers = callers
        self._engine = engine

    async def SetTenant(
        self, request: gateway_pb2.SetTenantRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.SetTenantResponse:
        await self._callers.authenticated(context, "SetTenant", request)
        changes = _changes(request)
        async with self._engine.begin() as conn:
            row = (
                await conn.execute(
                    update(tenants)
                    .where(tenants.c.tenant_id == request.tenant_id)
                    .values(**changes)
                    .returning(tenants.c.weight, tenants.c.max_running)
                )
            ).first()
            if row is None:
                raise NotFound(f"tenant {request.tenant_id!r} not found")
            await audit.record(
                conn,
                tenant_id=request.tenant_id,
                action="tenant.updated",
                actor={"kind": apikeys.OPERATOR_ID},
                settings=changes,
            )
        return gateway_pb2.SetTenantResponse(
            tenant_id=request.tenant_id, weight=row.weight, max_running=row.max_running
        )
