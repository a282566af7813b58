"""The channel-connection RPCs of tether.v1.InteractionsService: protobuf stops here, the store
sees ChannelSpec and answers ChannelInfo."""

from __future__ import annotations

from datetime import timedelta

import grpc

from services.interactions.channel_store import MAX_GRACE, ChannelInfo, ChannelSpec, ChannelStore
from services.interactions.domain import Orchestrator
from tether.convert import timestamp
from tether.domain.channels import channel_principal
from tether.errors import InvalidArgument, NotFound
from tether.v1 import interactions_pb2 as pb


def channel_info(info: ChannelInfo) -> pb.ChannelInfo:
    """The read model of a connection: each secret's name and last four, never a value."""
    message = pb.ChannelInfo(
        channel_id=info.channel_id,
        kind=info.kind,
        name=info.name,
        agent=info.agent,
        api_base_url=info.api_base_url,
        reply_url=info.reply_url,
        settings=info.settings,
        secrets=[
            pb.SecretInfo(name=name, last_four=last_four)
            for name, last_four in info.secret_hints.items()
        ],
        created_by=info.created_by,
        created_at=timestamp(info.created_at),
    )
    previous = timestamp(info.previous_secret_expires_at)
    if previous is not None:
        message.previous_secret_expires_at.CopyFrom(previous)
    return message


def _spec(request: pb.InteractionsServiceAddChannelRequest) -> ChannelSpec:
    secrets = {
        field.name: value.encode()
        for field, value in request.secrets.ListFields()
        if isinstance(value, str)
    }
    settings = {field.name: value for field, value in request.settings.ListFields()}
    return ChannelSpec(
        kind=request.kind,
        name=request.name,
        agent=request.agent,
        api_base_url=request.api_base_url,
        reply_url=request.reply_url,
        settings=settings,
        secrets=secrets,
    )


def _tenant(tenant_id: str) -> str:
    if not tenant_id:
        raise InvalidArgument("tenant_id is required")
    return tenant_id


_PAST_MAX_GRACE_MS = int(MAX_GRACE.total_seconds() * 1000) + 1


class ChannelRpcs:
    """Serves the channel-connection RPCs from the store."""

    def __init__(self, store: ChannelStore, orchestrator: Orchestrator) -> None:
        self._store = store
        self._orchestrator = orchestrator

    async def AddChannel(
        self, request: pb.InteractionsServiceAddChannelRequest, context: grpc.aio.ServicerContext
    ) -> pb.InteractionsServiceAddChannelResponse:
        tenant_id = _tenant(request.tenant_id)
        info = await self._store.add(tenant_id, request.principal_id, _spec(request))
        return pb.InteractionsServiceAddChannelResponse(channel=channel_info(info))

    async def ListChannels(
        self, request: pb.InteractionsServiceListChannelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.InteractionsServiceListChannelsResponse:
        listed = await self._store.list(_tenant(request.tenant_id))
        return pb.InteractionsServiceListChannelsResponse(
            channels=[channel_info(i) for i in listed]
        )

    async def GetChannel(
        self, request: pb.InteractionsServiceGetChannelRequest, context: grpc.aio.ServicerContext
    ) -> pb.InteractionsServiceGetChannelResponse:
        info = await self._store.get(_tenant(request.tenant_id), request.channel_id)
        return pb.InteractionsServiceGetChannelResponse(channel=channel_info(info))

    async def RemoveChannel(
        self,
        request: pb.InteractionsServiceRemoveChannelRequest,
        context: grpc.aio.ServicerContext,
    ) -> pb.InteractionsServiceRemoveChannelResponse:
        await self._store.remove(_tenant(request.tenant_id), request.channel_id)
        return pb.InteractionsServiceRemoveChannelResponse()

    async def RotateChannelSecret(
        self,
        request: pb.InteractionsServiceRotateChannelSecretRequest,
        context: grpc.aio.ServicerContext,
    ) -> pb.InteractionsServiceRotateChannelSecretResponse:
        info = await self._store.rotate(
            _tenant(request.tenant_id),
            request.channel_id,
            request.secret.encode(),
            # Past the store's bound by a millisecond at most, so the one rule there refuses it
            # (an unbounded uint64 would not fit a duration at all).
            timedelta(milliseconds=min(request.grace_ms, _PAST_MAX_GRACE_MS)),
        )
        return pb.InteractionsServiceRotateChannelSecretResponse(channel=channel_info(info))

    async def LookupChannelVerification(
        self, request: pb.LookupChannelVerificationRequest, context: grpc.aio.ServicerContext
    ) -> pb.LookupChannelVerificationResponse:
        found = await self._store.verification(request.channel_id)
        answer = pb.LookupChannelVerificationResponse(
            tenant_id=found.tenant_id,
            kind=found.kind,
            secrets=[s.decode() for s in found.secrets],
            verify_token=found.verify_token.decode(),
            settings=pb.ChannelSettings(**found.settings),
            agent=found.agent,
        )
        expires = timestamp(found.previous_expires_at)
        if expires is not None:
            answer.previous_secret_expires_at.CopyFrom(expires)
        return answer

    async def LookupChannelDelivery(
        self, request: pb.LookupChannelDeliveryRequest, context: grpc.aio.ServicerContext
    ) -> pb.LookupChannelDeliveryResponse:
        """The sending credential of a connection, for the live lease of a run its principal
        owns: a worker holding some other run's lease learns nothing (NOT_FOUND, as absent)."""
        run = await self._orchestrator.leased_run(request.run_id, request.epoch)
        if run.owner_principal_id != channel_principal(request.channel_id):
            raise NotFound(f"no channel {request.channel_id!r}")
        found = await self._store.sending(run.tenant_id, request.channel_id)
        return pb.LookupChannelDeliveryResponse(
            kind=found.kind,
            api_base_url=found.api_base_url,
            reply_url=found.reply_url,
            settings=found.settings,
            credential=found.credential,
            signing_secret=found.signing_secret,
        )
