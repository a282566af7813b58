"""The gateway's channel-connection RPCs: a tenant connects Slack, WhatsApp or any system that
signs its webhooks. Every call authenticates first and names the caller's tenant, never the
body's; interactions keeps the secrets and no answer carries one. The webhook URL an answer
names is the gateway's public address (TETHER_GATEWAY_PUBLIC_URL, else where its HTTP bridge
listens) with /v2/webhooks/{kind}/{channel_id}."""

from __future__ import annotations

from datetime import timedelta

import grpc

from services.gateway.grpc.callers import Callers
from tether.v1 import gateway_pb2, interactions_pb2, interactions_pb2_grpc

# A provider keeps signing with the old secret until someone updates its configuration: a day
# covers that without keeping a leaked secret useful for long.
DEFAULT_GRACE = timedelta(hours=24)


class ChannelRpcs:
    """Implements the channels part of tether.v1.GatewayService."""

    def __init__(
        self,
        callers: Callers,
        interactions: interactions_pb2_grpc.InteractionsServiceStub,
        public_url: str,
    ) -> None:
        self._callers = callers
        self._interactions = interactions
        self._public_url = public_url.rstrip("/")

    def listening_at(self, http_url: str) -> None:
        """The HTTP bridge's address, the public one when the operator named none."""
        if not self._public_url:
            self._public_url = http_url.rstrip("/")

    def webhook_url(self, kind: str, channel_id: str) -> str:
        """Where a connection's provider sends its webhooks."""
        return f"{self._public_url}/v2/webhooks/{kind}/{channel_id}"

    async def AddChannel(
        self, request: gateway_pb2.AddChannelRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.AddChannelResponse:
        principal = await self._callers.authenticated(context, "AddChannel", request)
        added = await self._interactions.AddChannel(
            interactions_pb2.InteractionsServiceAddChannelRequest(
                tenant_id=principal.tenant_id,
                principal_id=principal.principal_id,
                kind=request.kind,
                name=request.name,
                agent=request.agent,
                api_base_url=request.api_base_url,
                reply_url=request.reply_url,
                secrets=request.secrets,
                settings=request.settings,
            )
        )
        channel = added.channel
        return gateway_pb2.AddChannelResponse(
            channel_id=channel.channel_id,
            webhook_url=self.webhook_url(channel.kind, channel.channel_id),
            channel=channel,
        )

    async def ListChannels(
        self, request: gateway_pb2.ListChannelsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListChannelsResponse:
        principal = await self._callers.authenticated(context, "ListChannels", request)
        listed = await self._interactions.ListChannels(
            interactions_pb2.InteractionsServiceListChannelsRequest(tenant_id=principal.tenant_id)
        )
        return gateway_pb2.ListChannelsResponse(channels=listed.channels)

    async def GetChannel(
        self, request: gateway_pb2.GetChannelRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GetChannelResponse:
        principal = await self._callers.authenticated(context, "GetChannel", request)
        found = await self._interactions.GetChannel(
            interactions_pb2.InteractionsServiceGetChannelRequest(
                tenant_id=principal.tenant_id, channel_id=request.channel_id
            )
        )
        return gateway_pb2.GetChannelResponse(
            channel=found.channel,
            webhook_url=self.webhook_url(found.channel.kind, found.channel.channel_id),
        )

    async def RemoveChannel(
        self, request: gateway_pb2.RemoveChannelRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.RemoveChannelResponse:
        principal = await self._callers.authenticated(context, "RemoveChannel", request)
        await self._interactions.RemoveChannel(
            interactions_pb2.InteractionsServiceRemoveChannelRequest(
                tenant_id=principal.tenant_id, channel_id=request.channel_id
            )
        )
        return gateway_pb2.RemoveChannelResponse(channel_id=request.channel_id)

    async def RotateChannelSecret(
        self, request: gateway_pb2.RotateChannelSecretRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.RotateChannelSecretResponse:
        principal = await self._callers.authenticated(context, "RotateChannelSecret", request)
        grace = (
            timedelta(seconds=request.grace_seconds)
            if request.HasField("grace_seconds")
            else DEFAULT_GRACE
        )
        # Interactions refuses a grace past its bound: the rule lives once, in its store.
        rotated = await self._interactions.RotateChannelSecret(
            interactions_pb2.InteractionsServiceRotateChannelSecretRequest(
                tenant_id=principal.tenant_id,
                channel_id=request.channel_id,
                secret=request.secret,
                grace_ms=int(grace.total_seconds() * 1000),
            )
        )
        return gateway_pb2.RotateChannelSecretResponse(channel=rotated.channel)
