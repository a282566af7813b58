"""The webhook-secret RPCs of tether.v1.InteractionsService (the orchestrator's alone, by
tether.credentials.POWERS): protobuf stops here."""

from __future__ import annotations

import grpc

from services.interactions.webhook_secrets import WebhookSecrets
from tether.v1 import interactions_pb2 as pb


class WebhookSecretRpcs:
    """Serves SealWebhookSecret, OpenWebhookSecret and DiscardWebhookSecret."""

    def __init__(self, secrets: WebhookSecrets) -> None:
        self._secrets = secrets

    async def SealWebhookSecret(
        self, request: pb.SealWebhookSecretRequest, context: grpc.aio.ServicerContext
    ) -> pb.SealWebhookSecretResponse:
        await self._secrets.seal(request.tenant_id, request.subscription_id, request.secret)
        return pb.SealWebhookSecretResponse()

    async def OpenWebhookSecret(
        self, request: pb.OpenWebhookSecretRequest, context: grpc.aio.ServicerContext
    ) -> pb.OpenWebhookSecretResponse:
        secret = await self._secrets.open(request.tenant_id, request.subscription_id)
        return pb.OpenWebhookSecretResponse(secret=secret)

    async def DiscardWebhookSecret(
        self, request: pb.DiscardWebhookSecretRequest, context: grpc.aio.ServicerContext
    ) -> pb.DiscardWebhookSecretResponse:
        await self._secrets.discard(request.tenant_id, request.subscription_id)
        return pb.DiscardWebhookSecretResponse()
