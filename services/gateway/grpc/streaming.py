"""StreamRun and StreamConversation, mixed into GatewayServicer: authenticate, then hand over to
the streams (services.gateway.live.streams, services.gateway.live.conversation)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing

import grpc
from google.protobuf.message import Message

from services.gateway.auth import Authenticator, KeyWatch
from services.gateway.live.conversation import conversation_items
from services.gateway.live.run_list import LiveRuns
from services.gateway.live.streams import Streams
from tether.apikeys import Principal
from tether.errors import CODE_METADATA_KEY, TetherError
from tether.v1 import gateway_pb2
from tether.visibility import viewer_of


async def end_resumably(context: grpc.aio.ServicerContext, exc: TetherError) -> None:
    """Abort with `exc`'s status, its stable code and, when it has one, the resume cursor."""
    metadata = [(CODE_METADATA_KEY, exc.code)]
    if "resume_key" in exc.details:
        metadata.append((str(exc.details["resume_key"]), str(exc.details["resume"])))
    context.set_trailing_metadata(tuple(metadata))
    await context.abort(exc.status, exc.message)


class StreamingServicer:
    """The streaming side of tether.v1.GatewayService, mixed into GatewayServicer."""

    _streams: Streams
    _live_runs: LiveRuns
    _auth: Authenticator
    _caller: Callable[[grpc.aio.ServicerContext, str, Message], Awaitable[Principal]]

    def _key_watch(self, context: grpc.aio.ServicerContext, method: str) -> KeyWatch:
        return KeyWatch(self._auth, dict(context.invocation_metadata() or ()), method)

    async def StreamRun(
        self, request: gateway_pb2.StreamRunRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.StreamRunResponse]:
        principal = await self._caller(context, "StreamRun", request)
        items = self._streams.run_items(
            viewer_of(principal),
            request.run_id,
            request.after_seq,
            include_deltas=request.include_deltas,
            batch_catch_up=request.batch_catch_up,
            key_watch=self._key_watch(context, "StreamRun"),
        )
        try:
            async with aclosing(items) as stream:
                async for item in stream:
                    yield item
        except TetherError as exc:
            await end_resumably(context, exc)

    async def StreamConversation(
        self, request: gateway_pb2.StreamConversationRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.StreamConversationResponse]:
        principal = await self._caller(context, "StreamConversation", request)
        items = conversation_items(
            self._streams,
            viewer_of(principal),
            request.conversation_id,
            request.cursor,
            include_deltas=request.include_deltas,
            key_watch=self._key_watch(context, "StreamConversation"),
        )
        try:
            async with aclosing(items) as stream:
                async for item in stream:
                    yield item
        except TetherError as exc:
            await end_resumably(context, exc)

    async def StreamRuns(
        self, request: gateway_pb2.StreamRunsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.StreamRunsResponse]:
        principal = await self._caller(context, "StreamRuns", request)
        items = self._live_runs.items(
            viewer_of(principal), request, key_watch=self._key_watch(context, "StreamRuns")
        )
        try:
            async with aclosing(items) as stream:
                async for item in stream:
                    yield item
        except TetherError as exc:
            await end_resumably(context, exc)
