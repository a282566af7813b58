"""The run-event webhook RPCs of tether.v1.OrchestratorService, and the orchestrator's calls to
interactions for the subscriptions' signing secrets: protobuf stops here."""

from __future__ import annotations

import grpc

from services.orchestrator.repositories.webhooks import Delivery, Subscription
from services.orchestrator.webhooks import Actor, Subscriptions
from tether.convert import timestamp
from tether.errors import InvalidArgument
from tether.v1 import common_pb2, interactions_pb2, interactions_pb2_grpc
from tether.v1 import orchestrator_pb2 as pb


class InteractionsSecrets:
    """Seals, opens and discards subscriptions' secrets in interactions (its RPCs the
    orchestrator alone may call)."""

    def __init__(self, stub: interactions_pb2_grpc.InteractionsServiceStub) -> None:
        self._stub = stub

    async def seal(self, tenant_id: str, subscription_id: str, secret: str) -> None:
        """Seal and store a subscription's secret."""
        await self._stub.SealWebhookSecret(
            interactions_pb2.SealWebhookSecretRequest(
                tenant_id=tenant_id, subscription_id=subscription_id, secret=secret
            )
        )

    async def open(self, tenant_id: str, subscription_id: str) -> str:
        """A subscription's secret, to sign with."""
        opened = await self._stub.OpenWebhookSecret(
            interactions_pb2.OpenWebhookSecretRequest(
                tenant_id=tenant_id, subscription_id=subscription_id
            )
        )
        secret: str = opened.secret
        return secret

    async def discard(self, tenant_id: str, subscription_id: str) -> None:
        """Remove a subscription's secret."""
        await self._stub.DiscardWebhookSecret(
            interactions_pb2.DiscardWebhookSecretRequest(
                tenant_id=tenant_id, subscription_id=subscription_id
            )
        )


def subscription_to_proto(found: Subscription) -> common_pb2.WebhookSubscription:
    """A subscription as every read shows it: never its secret."""
    message = common_pb2.WebhookSubscription(
        subscription_id=found.subscription_id,
        url=found.url,
        events=list(found.events),
        created_by=found.created_by,
        created_at=timestamp(found.created_at),
        status="disabled" if found.disabled_at is not None else "enabled",
    )
    for field, value in (
        ("disabled_at", found.disabled_at),
        ("failing_since", found.failing_since),
    ):
        stamped = timestamp(value)
        if stamped is not None:
            getattr(message, field).CopyFrom(stamped)
    return message


def delivery_to_proto(found: Delivery) -> common_pb2.WebhookDelivery:
    """A delivery of the log."""
    message = common_pb2.WebhookDelivery(
        delivery_id=found.delivery_id,
        subscription_id=found.subscription_id,
        run_id=found.run_id,
        seq=found.seq,
        event_type=found.event_type,
        status=found.status,
        attempts=found.attempts,
        last_http_status=found.last_http_status or 0,
        last_error=found.last_error or "",
        created_at=timestamp(found.created_at),
    )
    for field, value in (("next_attempt_at", found.next_attempt_at), ("sent_at", found.sent_at)):
        stamped = timestamp(value) if field == "sent_at" or found.status == "pending" else None
        if stamped is not None:
            getattr(message, field).CopyFrom(stamped)
    return message


def _actor(actor: pb.AgentActor) -> Actor:
    if not actor.tenant_id:
        raise InvalidArgument("actor.tenant_id is required")
    return Actor(actor.tenant_id, actor.key_id, actor.principal_id)


def _tenant(tenant_id: str) -> str:
    if not tenant_id:
        raise InvalidArgument("tenant_id is required")
    return tenant_id


class WebhookRpcs:
    """Serves the webhook RPCs from the subscriptions' service."""

    def __init__(self, subscriptions: Subscriptions) -> None:
        self._subscriptions = subscriptions

    async def CreateWebhookSubscription(
        self, request: pb.CreateWebhookSubscriptionRequest, context: grpc.aio.ServicerContext
    ) -> pb.CreateWebhookSubscriptionResponse:
        added = await self._subscriptions.add(
            _actor(request.actor), request.url, list(request.events), request.secret
        )
        return pb.CreateWebhookSubscriptionResponse(subscription=subscription_to_proto(added))

    async def SearchWebhookSubscriptions(
        self, request: pb.SearchWebhookSubscriptionsRequest, context: grpc.aio.ServicerContext
    ) -> pb.SearchWebhookSubscriptionsResponse:
        listed = await self._subscriptions.listed(_tenant(request.tenant_id))
        return pb.SearchWebhookSubscriptionsResponse(
            subscriptions=[subscription_to_proto(s) for s in listed]
        )

    async def DeleteWebhookSubscription(
        self, request: pb.DeleteWebhookSubscriptionRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteWebhookSubscriptionResponse:
        await self._subscriptions.remove(_actor(request.actor), request.subscription_id)
        return pb.DeleteWebhookSubscriptionResponse()

    async def SearchWebhookDeliveries(
        self, request: pb.SearchWebhookDeliveriesRequest, context: grpc.aio.ServicerContext
    ) -> pb.SearchWebhookDeliveriesResponse:
        listed = await self._subscriptions.deliveries(
            _tenant(request.tenant_id), request.subscription_id, request.limit
        )
        return pb.SearchWebhookDeliveriesResponse(deliveries=[delivery_to_proto(d) for d in listed])

    async def RequeueWebhookDelivery(
        self, request: pb.RequeueWebhookDeliveryRequest, context: grpc.aio.ServicerContext
    ) -> pb.RequeueWebhookDeliveryResponse:
        requeued = await self._subscriptions.redeliver(_actor(request.actor), request.delivery_id)
        return pb.RequeueWebhookDeliveryResponse(delivery=delivery_to_proto(requeued))
