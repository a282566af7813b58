"""Following a run or a conversation from Python: async iterators that reconnect by themselves.

    async with TetherClient.from_env(stack) as client:
        async for item in client.watch(run_id, include_deltas=True):
            ...  # a StreamRunResponse: a snapshot, or an event

A watch keeps the cursor of what it delivered. When the stream breaks (the gateway restarts or
is unreachable for a while, or ends the stream because the consumer fell behind) it reconnects
with that cursor, so every durable event is yielded exactly once and in seq order. A snapshot
starts every connection, the first and each reconnect: it is the persisted state as of
`snapshot.run.last_seq`. The catch-up after the cursor is fetched in batches
(`batch_catch_up`) and handed out one event per item.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Sequence

import grpc

from tether.transport import TERMINAL_TYPES
from tether.v1 import common_pb2, events_pb2, gateway_pb2, gateway_pb2_grpc

# Worth reconnecting after: the gateway is restarting or unreachable, or it ended the stream
# and named the cursor to resume from (a slow consumer, a gateway shutting down).
RECONNECT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
    }
)
_TERMINAL = frozenset(
    {common_pb2.RUN_STATUS_COMPLETED, common_pb2.RUN_STATUS_FAILED, common_pb2.RUN_STATUS_CANCELLED}
)
Metadata = Sequence[tuple[str, str]]


def _single(event: events_pb2.RunEvent) -> gateway_pb2.StreamRunResponse:
    item = gateway_pb2.StreamRunResponse()
    item.event.CopyFrom(event)
    return item


class _Backoff:
    """Exponential backoff with full jitter, reset by progress; gives up after a long outage."""

    def __init__(self, give_up_after_s: float | None) -> None:
        self._give_up_after = give_up_after_s
        self._failing_since: float | None = None
        self._delay = 0.05

    def progressed(self) -> None:
        self._failing_since = None
        self._delay = 0.05

    async def wait(self, error: grpc.aio.AioRpcError) -> None:
        """Sleep before the next attempt; re-raise `error` once the outage is too long."""
        loop = asyncio.get_running_loop()
        if self._failing_since is None:
            self._failing_since = loop.time()
        if (
            self._give_up_after is not None
            and loop.time() - self._failing_since > self._give_up_after
        ):
            raise error
        if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return  # the consumer was too slow, not the gateway: catch up at once
        await asyncio.sleep(random.uniform(0, self._delay))  # full jitter
        self._delay = min(self._delay * 2, 2.0)


class RunWatch:
    """A run's stream across reconnects; iteration ends after the run's terminal event.

    `cursor` is the seq of the last durable event delivered; `reconnects` counts attempts to
    reconnect (each failed try during an outage included). Errors that reconnecting cannot fix
    (NOT_FOUND, PERMISSION_DENIED, UNAUTHENTICATED, INVALID_ARGUMENT) are raised, as is the
    last error of an outage longer than `give_up_after_s` (None: never give up).
    """

    def __init__(
        self,
        stub: gateway_pb2_grpc.GatewayServiceStub,
        metadata: Metadata,
        run_id: str,
        *,
        after_seq: int = 0,
        include_deltas: bool = False,
        give_up_after_s: float | None = 60.0,
    ) -> None:
        self.run_id = run_id
        self.cursor = after_seq
        self.include_deltas = include_deltas
        self.reconnects = 0
        self._stub = stub
        self._metadata = metadata
        self._give_up_after = give_up_after_s

    def __aiter__(self) -> AsyncIterator[gateway_pb2.StreamRunResponse]:
        return self._items()

    async def _items(self) -> AsyncIterator[gateway_pb2.StreamRunResponse]:
        backoff = _Backoff(self._give_up_after)
        while True:
            call = self._stub.StreamRun(
                gateway_pb2.StreamRunRequest(
                    run_id=self.run_id,
                    after_seq=self.cursor,
                    include_deltas=self.include_deltas,
                    batch_catch_up=True,
                ),
                metadata=self._metadata,
            )
            finished = False
            try:
                async for response in call:
                    backoff.progressed()
                    kind = response.WhichOneof("item")
                    if kind == "snapshot":
                        run = response.snapshot.run
                        finished = run.status in _TERMINAL and self.cursor >= run.last_seq
                        yield response
                        continue
                    # The catch-up may come in batches; the consumer sees one event per item.
                    events = response.batch.events if kind == "batch" else (response.event,)
                    for event in events:
                        if event.seq:
                            if event.seq <= self.cursor:
                                continue  # already delivered before a reconnect
                            self.cursor = event.seq
                        yield response if kind == "event" else _single(event)
                        if event.type in TERMINAL_TYPES:
                            return
                if finished:
                    return  # the run had ended before this cursor
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in RECONNECT_CODES:
                    raise
                await backoff.wait(exc)
            finally:
                call.cancel()
            self.reconnects += 1


class ConversationWatch:
    """Every run of a conversation across reconnects (it never ends by itself).

    `cursor` is the resumable cursor of the last item delivered.
    """

    def __init__(
        self,
        stub: gateway_pb2_grpc.GatewayServiceStub,
        metadata: Metadata,
        conversation_id: str,
        *,
        cursor: str = "",
        include_deltas: bool = False,
        give_up_after_s: float | None = 60.0,
    ) -> None:
        self.conversation_id = conversation_id
        self.cursor = cursor
        self.include_deltas = include_deltas
        self.reconnects = 0
        self._stub = stub
        self._metadata = metadata
        self._give_up_after = give_up_after_s

    def __aiter__(self) -> AsyncIterator[gateway_pb2.StreamConversationResponse]:
        return self._items()

    async def _items(self) -> AsyncIterator[gateway_pb2.StreamConversationResponse]:
        backoff = _Backoff(self._give_up_after)
        while True:
            call = self._stub.StreamConversation(
                gateway_pb2.StreamConversationRequest(
                    conversation_id=self.conversation_id,
                    cursor=self.cursor,
                    include_deltas=self.include_deltas,
                ),
                metadata=self._metadata,
            )
            try:
                async for response in call:
                    backoff.progressed()
                    self.cursor = response.cursor or self.cursor
                    yield response
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in RECONNECT_CODES:
                    raise
                await backoff.wait(exc)
            finally:
                call.cancel()
            self.reconnects += 1
