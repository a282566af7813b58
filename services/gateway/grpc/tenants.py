"""Deleting a tenant: the platform operator's `DeleteTenant`, across every service that owns some
of its data.

Each call does a bounded part and says what remains, so a large tenant is deleted over many
calls (`tether tenant delete` repeats them) and a call interrupted anywhere leaves nothing
half-written: every step removes whole rows in transactions of its own, and is done again by
the next call. The order follows what names what: the runs first (the orchestrator: each with
its aggregate; its claim becomes a tombstone and its interactions go with it), then the
claims, messages and sessions (admission), grants, connections and what is left of
interactions (the interactions service), and last, here, the tenant's audit records, keys and
the tenant itself. Its keys are revoked on the first call; the tenant row goes only once no
replica can still trust a cached copy of one (the revocation bound), so no run can be admitted
after the services were emptied.
"""

from __future__ import annotations

import grpc
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from services.gateway.auth import Authenticator
from services.gateway.grpc.callers import Callers
from services.gateway.grpc.tenant_settings import TenantSettingsRpcs
from tether import apikeys, audit
from tether.errors import NotFound
from tether.v1 import (
    admission_pb2,
    admission_pb2_grpc,
    gateway_pb2,
    interactions_pb2,
    interactions_pb2_grpc,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
)


class TenantRpcs:
    """Implements DeleteTenant and SetTenant (`tenant_settings`) of tether.v1.GatewayService."""

    def __init__(
        self,
        *,
        callers: Callers,
        auth: Authenticator,
        engine: AsyncEngine,
        admission: admission_pb2_grpc.AdmissionServiceStub,
        orchestrator: orchestrator_pb2_grpc.OrchestratorServiceStub,
        interactions: interactions_pb2_grpc.InteractionsServiceStub,
        revocation_bound_s: float,
    ) -> None:
        self._callers = callers
        # Its keys are forgotten here at once; the other replicas within the revocation bound.
        self._auth = auth
        self._engine = engine
        self._admission = admission
        self._orchestrator = orchestrator
        self._interactions = interactions
        # How long a revoked key may still be trusted from a replica's cache: the tenant row
        # goes only after that.
        self._revocation_bound_s = revocation_bound_s
        self._settings = TenantSettingsRpcs(callers=callers, engine=engine)

    async def SetTenant(
        self, request: gateway_pb2.SetTenantRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.SetTenantResponse:
        return await self._settings.SetTenant(request, context)

    async def DeleteTenant(
        self, request: gateway_pb2.DeleteTenantRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.DeleteTenantResponse:
        await self._callers.authenticated(context, "DeleteTenant", request)
        tenant_id = request.tenant_id
        async with self._engine.begin() as conn:
            if not await apikeys.tenant_exists(conn, tenant_id):
                raise NotFound(f"tenant {tenant_id!r} not found")
            revoked_s_ago = await apikeys.revoke_tenant_keys(conn, tenant_id)
        self._auth.forget_tenant(tenant_id)
        response = gateway_pb2.DeleteTenantResponse()
        runs = await self._orchestrator.DeleteTenantRuns(
            orchestrator_pb2.DeleteTenantRunsRequest(tenant_id=tenant_id)
        )
        response.removed["runs"] = runs.removed
        if runs.remaining:
            response.pending = "runs of the tenant remain"
            return response
        events = await self._admission.DeleteTenantEvents(
            admission_pb2.DeleteTenantEventsRequest(tenant_id=tenant_id)
        )
        response.removed["events"] = events.removed
        interactions = await self._interactions.DeleteTenantInteractions(
            interactions_pb2.DeleteTenantInteractionsRequest(tenant_id=tenant_id)
        )
        response.removed["interactions"] = interactions.removed
        if events.remaining or interactions.remaining:
            response.pending = "claims, messages, sessions, grants or connections remain"
            return response
        if revoked_s_ago is not None:
            trusted_for = self._revocation_bound_s - revoked_s_ago
            if trusted_for > 0:
                response.pending = (
                    f"its keys were revoked; a gateway may trust a cached one for {trusted_for:.1f}"
                    " s more, so the tenant itself goes on a call after that"
                )
                return response
        try:
            async with self._engine.begin() as conn:
                response.removed["audit"] = await audit.forget_tenant(conn, tenant_id)
                response.removed["keys"] = await apikeys.delete_tenant(conn, tenant_id)
                await audit.record(
                    conn,
                    tenant_id=tenant_id,
                    action="tenant.deleted",
                    actor={"kind": apikeys.OPERATOR_ID},
                )
        except IntegrityError:
            # A session was made since the services were emptied (a key trusted from a
            # cache): nothing was removed here; the next call removes it first.
            response.pending = "data arrived while the tenant was being deleted"
            response.removed.pop("audit", None)
            response.removed.pop("keys", None)
            return response
        response.deleted = True
        return response
