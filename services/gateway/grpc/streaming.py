"""The streaming RPCs (StreamRun, StreamConversation, StreamRuns): authenticate, then hand over
to the streams of `live/`; a stream that ends early ends with the cursor to resume from."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing

import grpc

from services.gateway.grpc.callers import Callers
from services.gateway.live.conversation import conversation_items
from services.gateway.live.run_list import LiveRuns
from services.gateway.live.streams import Streams
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


class StreamRpcs:
    """Implements the streaming part of tether.v1.GatewayService."""

    def __init__(self, callers: Callers, streams: Streams, live_runs: LiveRuns) -> None:
        self._callers = callers
        self._streams = streams
        self._live_runs = live_runs

    async def StreamRun(
        self, request: gateway_pb2.StreamRunRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[gateway_pb2.StreamRunResponse, None]:
        principal = await self._callers.authenticated(context, "StreamRun", request)
        items = self._streams.run_items(
            viewer_of(principal),
            request.run_id,
            request.after_seq,
            include_deltas=request.include_deltas,
            batch_catch_up=request.batch_catch_up,
            key_watch=self._callers.key_watch(context, "StreamRun"),
        )
        try:
            async with aclosing(items) as stream:
                async for item in stream:
                    yield item
        except TetherError as exc:
            await end_resumably(context, exc)

    async def StreamConversation(
        self, request: gateway_pb2.StreamConversationRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[gateway_pb2.StreamConversationResponse, None]:
        principal = await self._callers.authenticated(context, "StreamConversation", request)
        items = conversation_items(
            self._streams,
            viewer_of(principal),
            request.conversation_id,
            request.cursor,
            include_deltas=request.include_deltas,
            key_watch=self._callers.key_watch(context, "StreamConversation"),
        )
        try:
            async with aclosing(items) as stream:
                async for item in stream:
                    yield item
        except TetherError as exc:
            await end_resumably(context, exc)

    async def StreamRuns(
        self, request: gateway_pb2.StreamRunsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[gateway_pb2.StreamRunsResponse, None]:
        principal = await self._callers.authenticated(context, "StreamRuns", request)
        items = self._live_runs.items(
            viewer_of(principal), request, key_watch=self._callers.key_watch(context, "StreamRuns")
        )
        try:
            async with aclosing(items) as stream:
                async for item in stream:
                    yield item
        except TetherError as exc:
            await end_resumably(context, exc)
