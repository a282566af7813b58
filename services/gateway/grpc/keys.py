"""The key RPCs: a tenant's key (or the platform operator) creates and revokes API keys, each
change with its audit record."""

from __future__ import annotations

from datetime import UTC, datetime

import grpc
from sqlalchemy.ext.asyncio import AsyncEngine

from services.gateway.auth import Authenticator
from services.gateway.grpc.callers import Callers
from tether import apikeys, audit
from tether.apikeys import Principal
from tether.domain.channels import CHANNEL_PRINCIPAL_PREFIX
from tether.errors import InvalidArgument, NotFound, PermissionDenied
from tether.ids import is_identifier
from tether.v1 import gateway_pb2


class KeyRpcs:
    """Implements CreateApiKey and RevokeApiKey of tether.v1.GatewayService."""

    def __init__(self, callers: Callers, auth: Authenticator, engine: AsyncEngine) -> None:
        self._callers = callers
        # A revoked key is forgotten here at once: this replica stops trusting it.
        self._auth = auth
        self._engine = engine

    async def CreateApiKey(
        self, request: gateway_pb2.CreateApiKeyRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.CreateApiKeyResponse:
        caller = await self._callers.authenticated(context, "CreateApiKey", request)
        tenant_id = request.tenant_id or ("" if caller.is_operator else caller.tenant_id)
        for name, value in (("tenant_id", tenant_id), ("principal_id", request.principal_id)):
            if not is_identifier(value, max_length=128):
                raise InvalidArgument(
                    f"{name} must be 1-128 characters of letters, digits and . _ : @ -"
                )
        if request.principal_id.startswith(CHANNEL_PRINCIPAL_PREFIX):
            raise InvalidArgument(
                f"principal ids starting with {CHANNEL_PRINCIPAL_PREFIX!r} belong to channel "
                "connections (their runs and conversations); choose another principal id",
                details={"field": "principal_id"},
            )
        if not caller.is_operator and tenant_id != caller.tenant_id:
            # The same answer whether that tenant exists or not.
            raise PermissionDenied("a tenant's key creates keys only in its own tenant")
        scopes = list(request.scopes) or list(apikeys.CLIENT_SCOPES)
        unknown = sorted(set(scopes) - set(apikeys.ALL_SCOPES))
        if unknown:
            raise InvalidArgument(
                f"unknown scopes {unknown}; known scopes are {list(apikeys.ALL_SCOPES)}"
            )
        wider = sorted(set(scopes) - caller.scopes)
        if wider and not caller.is_operator:
            raise PermissionDenied(f"a key cannot grant scopes it does not hold: {wider}")
        expires_at = None
        if request.HasField("expires_at"):
            expires_at = request.expires_at.ToDatetime(tzinfo=UTC)
            if expires_at <= datetime.now(UTC):
                raise InvalidArgument("expires_at must be in the future")
        async with self._engine.begin() as conn:
            if caller.is_operator:
                await apikeys.ensure_tenant(conn, tenant_id)
            secret, created = await apikeys.create_key(
                conn, tenant_id, request.principal_id, scopes, expires_at=expires_at
            )
            await audit.record(
                conn,
                tenant_id=tenant_id,
                action="key.created",
                actor=_actor(caller),
                key_id=created.key_id,
                principal_id=created.principal_id,
                scopes=sorted(created.scopes),
                expires_at=None if expires_at is None else expires_at.isoformat(),
            )
        response = gateway_pb2.CreateApiKeyResponse(
            api_key=secret,
            key_id=created.key_id,
            tenant_id=created.tenant_id,
            principal_id=created.principal_id,
            scopes=sorted(created.scopes),
        )
        if request.HasField("expires_at"):
            response.expires_at.CopyFrom(request.expires_at)
        return response

    async def RevokeApiKey(
        self, request: gateway_pb2.RevokeApiKeyRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.RevokeApiKeyResponse:
        caller = await self._callers.authenticated(context, "RevokeApiKey", request)
        absent = NotFound(f"API key {request.key_id!r} not found")
        if not is_identifier(request.key_id, max_length=128):
            raise absent
        async with self._engine.begin() as conn:
            found = await apikeys.revoke_key(
                conn, request.key_id, None if caller.is_operator else caller.tenant_id
            )
            if found is None:
                raise absent  # another tenant's key gets the same answer as an absent one
            key, revoked = found
            if revoked:
                await audit.record(
                    conn,
                    tenant_id=key.tenant_id,
                    action="key.revoked",
                    actor=_actor(caller),
                    key_id=key.key_id,
                    principal_id=key.principal_id,
                    scopes=sorted(key.scopes),
                )
        # This replica stops at once; the others within their cache TTL.
        self._auth.forget(key.key_id)
        return gateway_pb2.RevokeApiKeyResponse(key_id=key.key_id, revoked=revoked)


def _actor(caller: Principal) -> dict[str, str]:
    """Who acted, for the audit trail."""
    if caller.is_operator:
        return {"kind": "operator"}
    return {"kind": "key", "key_id": caller.key_id, "principal_id": caller.principal_id}
