"""The gateway's secret RPCs: a tenant adds, lists and removes the named secrets interactions
keeps sealed. Every call authenticates first and names the caller's tenant, never the body's;
no answer carries a value."""

from __future__ import annotations

import grpc

from services.gateway.grpc.callers import Callers
from tether.v1 import gateway_pb2, interactions_pb2, interactions_pb2_grpc


class SecretRpcs:
    """Implements the secrets part of tether.v1.GatewayService."""

    def __init__(
        self, callers: Callers, interactions: interactions_pb2_grpc.InteractionsServiceStub
    ) -> None:
        self._callers = callers
        self._interactions = interactions

    async def AddSecret(
        self, request: gateway_pb2.AddSecretRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.AddSecretResponse:
        principal = await self._callers.authenticated(context, "AddSecret", request)
        stored = await self._interactions.AddSecret(
            interactions_pb2.InteractionsServiceAddSecretRequest(
                tenant_id=principal.tenant_id,
                principal_id=principal.principal_id,
                name=request.name,
                value=request.value.encode(),
            )
        )
        return gateway_pb2.AddSecretResponse(secret=stored.secret)

    async def ListSecrets(
        self, request: gateway_pb2.ListSecretsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListSecretsResponse:
        principal = await self._callers.authenticated(context, "ListSecrets", request)
        listed = await self._interactions.ListSecrets(
            interactions_pb2.InteractionsServiceListSecretsRequest(tenant_id=principal.tenant_id)
        )
        return gateway_pb2.ListSecretsResponse(secrets=listed.secrets)

    async def RemoveSecret(
        self, request: gateway_pb2.RemoveSecretRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.RemoveSecretResponse:
        principal = await self._callers.authenticated(context, "RemoveSecret", request)
        await self._interactions.RemoveSecret(
            interactions_pb2.InteractionsServiceRemoveSecretRequest(
                tenant_id=principal.tenant_id, name=request.name
            )
        )
        return gateway_pb2.RemoveSecretResponse(name=request.name)
