"""The gateway's run-event webhook RPCs: a tenant subscribes its endpoints to its runs' events.
Every call authenticates first and names the caller's tenant, never the body's; the orchestrator
keeps the subscriptions and their delivery log, interactions the signing secrets, and no answer
carries a secret."""

from __future__ import annotations

import grpc

from services.gateway.grpc.callers import Callers
from tether.apikeys import Principal
from tether.v1 import gateway_pb2, orchestrator_pb2, orchestrator_pb2_grpc


def _actor(principal: Principal) -> orchestrator_pb2.AgentActor:
    return orchestrator_pb2.AgentActor(
        tenant_id=principal.tenant_id,
        key_id=principal.key_id,
        principal_id=principal.principal_id,
    )


class WebhookRpcs:
    """Implements the webhooks part of tether.v1.GatewayService."""

    def __init__(
        self, callers: Callers, orchestrator: orchestrator_pb2_grpc.OrchestratorServiceStub
    ) -> None:
        self._callers = callers
        self._orchestrator = orchestrator

    async def AddWebhook(
        self, request: gateway_pb2.AddWebhookRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.AddWebhookResponse:
        principal = await self._callers.authenticated(context, "AddWebhook", request)
        created = await self._orchestrator.CreateWebhookSubscription(
            orchestrator_pb2.CreateWebhookSubscriptionRequest(
                actor=_actor(principal),
                url=request.url,
                events=request.events,
                secret=request.secret,
            )
        )
        return gateway_pb2.AddWebhookResponse(
            subscription_id=created.subscription.subscription_id,
            subscription=created.subscription,
        )

    async def ListWebhooks(
        self, request: gateway_pb2.ListWebhooksRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListWebhooksResponse:
        principal = await self._callers.authenticated(context, "ListWebhooks", request)
        found = await self._orchestrator.SearchWebhookSubscriptions(
            orchestrator_pb2.SearchWebhookSubscriptionsRequest(tenant_id=principal.tenant_id)
        )
        return gateway_pb2.ListWebhooksResponse(subscriptions=found.subscriptions)

    async def RemoveWebhook(
        self, request: gateway_pb2.RemoveWebhookRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.RemoveWebhookResponse:
        principal = await self._callers.authenticated(context, "RemoveWebhook", request)
        await self._orchestrator.DeleteWebhookSubscription(
            orchestrator_pb2.DeleteWebhookSubscriptionRequest(
                actor=_actor(principal), subscription_id=request.subscription_id
            )
        )
        return gateway_pb2.RemoveWebhookResponse(subscription_id=request.subscription_id)

    async def ListWebhookDeliveries(
        self, request: gateway_pb2.ListWebhookDeliveriesRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListWebhookDeliveriesResponse:
        principal = await self._callers.authenticated(context, "ListWebhookDeliveries", request)
        found = await self._orchestrator.SearchWebhookDeliveries(
            orchestrator_pb2.SearchWebhookDeliveriesRequest(
                tenant_id=principal.tenant_id,
                subscription_id=request.subscription_id,
                limit=request.page_size,
            )
        )
        return gateway_pb2.ListWebhookDeliveriesResponse(deliveries=found.deliveries)

    async def RedeliverWebhook(
        self, request: gateway_pb2.RedeliverWebhookRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.RedeliverWebhookResponse:
        principal = await self._callers.authenticated(context, "RedeliverWebhook", request)
        requeued = await self._orchestrator.RequeueWebhookDelivery(
            orchestrator_pb2.RequeueWebhookDeliveryRequest(
                actor=_actor(principal), delivery_id=request.delivery_id
            )
        )
        return gateway_pb2.RedeliverWebhookResponse(delivery=requeued.delivery)
