"""Run streams: the persisted state, then every durable event after the
client's cursor, then the live tail, with no duplicate and no gap.

The order matters. A stream subscribes to the run's live channel first and reads PostgreSQL
second, so an event committed after the read is published after the subscription and arrives
live. Live events are de-duplicated by seq against the cursor; one that skips a seq means Redis
lost something, and the stream re-reads PostgreSQL from its cursor. While Redis is unavailable
the stream polls PostgreSQL; PostgreSQL is also re-read whenever a stream has been quiet for a
keepalive interval, so even a lost final event is found.

A stream that cannot keep up (its feed overflowed) or that the gateway ends (shutdown) fails
with a resumable status: the code and the cursor to resume from travel in trailing metadata.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from google.protobuf import json_format

from services.gateway.live.hub import EventHub, LiveEvent, Signal
from services.gateway.settings import GatewaySettings
from tether.domain import EventType
from tether.errors import (
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    TetherError,
    Unavailable,
)
from tether.ids import is_identifier
from tether.transport import RESUME_SEQ_KEY, STATUS_AFTER, TERMINAL_TYPES
from tether.v1 import (
    common_pb2,
    events_pb2,
    gateway_pb2,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
)
from tether.visibility import Viewer

if TYPE_CHECKING:
    from services.gateway.auth import KeyWatch


class SlowConsumer(ResourceExhausted):
    """The client fell further behind the live tail than its buffer holds."""

    default_code = "slow_consumer"


class StreamInterrupted(Unavailable):
    """The gateway ended the stream (it is stopping); another replica serves the resume."""

    default_code = "stream_interrupted"


def resumable(cls: type[TetherError], key: str, resume: str, what: str) -> TetherError:
    """A stream-ending error carrying the cursor to resume from."""
    message = {
        SlowConsumer: f"the client fell behind the live stream; reconnect with {what}",
        StreamInterrupted: f"the gateway is stopping; reconnect with {what}",
    }[cls]
    return cls(message, details={"resume_key": key, "resume": resume})


@dataclass(frozen=True)
class StreamTiming:
    """How streams pace themselves (from the gateway's settings)."""

    keepalive_s: float = 5.0
    poll_s: float = 0.25
    page_size: int = 2000
    conversation_poll_s: float = 1.0


def build_streams(
    settings: GatewaySettings, orchestrator: orchestrator_pb2_grpc.OrchestratorServiceStub
) -> Streams:
    """The process's streams and their event hub (not yet connected: `streams.hub.start`)."""
    hub = EventHub(
        settings.redis_url,
        feed_capacity=settings.stream_buffer,
        linger_s=settings.subscription_linger_s,
    )
    timing = StreamTiming(
        keepalive_s=settings.keepalive_interval_s,
        poll_s=settings.poll_interval_s,
        page_size=settings.stream_page_size,
        conversation_poll_s=settings.conversation_poll_s,
    )
    return Streams(orchestrator, hub, timing)


class RunCursor:
    """A run's delivery position: de-duplication by seq, status and whether it ended."""

    def __init__(self, run_id: str, seq: int, status: common_pb2.RunStatus.ValueType) -> None:
        self.run_id = run_id
        self.seq = seq
        self.status = status
        self.ended = False

    def accept(self, seq: int, type_: str) -> bool:
        """Whether a durable event is new; advances the cursor when it is."""
        if seq <= self.seq:
            return False
        self.seq = seq
        self.status = STATUS_AFTER.get(type_, self.status)
        self.ended = self.ended or type_ in TERMINAL_TYPES
        return True


def keepalive(run_id: str, status: common_pb2.RunStatus.ValueType) -> events_pb2.RunEvent:
    """An ephemeral keepalive carrying the run's status."""
    event = events_pb2.RunEvent(run_id=run_id, type=EventType.KEEPALIVE)
    event.created_at.GetCurrentTime()
    event.keepalive.status = status
    return event


def live_proto(live: LiveEvent) -> events_pb2.RunEvent | None:
    """The live event's protobuf form; None when the published message is malformed (the
    stream then re-reads PostgreSQL, which holds the truth)."""
    try:
        return live.event
    except (json_format.ParseError, ValueError, KeyError, TypeError):
        return None


class Streams:
    """The streams of one gateway process, over the orchestrator's log and the event hub."""

    def __init__(
        self,
        orchestrator: orchestrator_pb2_grpc.OrchestratorServiceStub,
        hub: EventHub,
        timing: StreamTiming,
    ) -> None:
        self.orchestrator = orchestrator
        self.hub = hub
        self.timing = timing

    async def read(
        self, viewer: Viewer, run_id: str, after_seq: int, *, include_state: bool = False
    ) -> orchestrator_pb2.ReadEventsResponse:
        """One page of the run's log after `after_seq` (with its state, in the same snapshot)."""
        response: orchestrator_pb2.ReadEventsResponse = await self.orchestrator.ReadEvents(
            orchestrator_pb2.ReadEventsRequest(
                **viewer.fields(),
                run_id=run_id,
                after_seq=after_seq,
                limit=self.timing.page_size,
                include_state=include_state,
            )
        )
        return response

    async def log_pages(
        self,
        viewer: Viewer,
        run_id: str,
        after_seq: int,
        first: orchestrator_pb2.ReadEventsResponse | None = None,
    ) -> AsyncIterator[Sequence[events_pb2.RunEvent]]:
        """Every durable event after `after_seq`, a page at a time; the next page is read while
        the current one is being sent."""
        page = first if first is not None else await self.read(viewer, run_id, after_seq)
        while True:
            ahead: asyncio.Future[orchestrator_pb2.ReadEventsResponse] | None = None
            if page.has_more and page.events:
                ahead = asyncio.ensure_future(self.read(viewer, run_id, page.events[-1].seq))
            try:
                yield page.events
            except BaseException:
                # The stream ended early (client gone, generator closed): drop the read ahead.
                if ahead is not None:
                    ahead.cancel()
                    with contextlib.suppress(asyncio.CancelledError, TetherError):
                        await ahead
                raise
            if ahead is None:
                return
            page = await ahead

    async def log_after(
        self, viewer: Viewer, run_id: str, after_seq: int
    ) -> AsyncIterator[events_pb2.RunEvent]:
        """Every durable event after `after_seq`, one at a time."""
        async for page in self.log_pages(viewer, run_id, after_seq):
            for event in page:
                yield event

    def wait_time(self, live: bool, quiet_since: float, checked_at: float, now: float) -> float:
        """How long a stream waits for its feed before it polls, re-checks or keeps alive."""
        if not live:
            return self.timing.poll_s
        keepalive = self.timing.keepalive_s
        return max(min(keepalive - (now - quiet_since), keepalive - (now - checked_at)), 0.01)

    async def run_items(
        self,
        viewer: Viewer,
        run_id: str,
        after_seq: int,
        *,
        include_deltas: bool,
        batch_catch_up: bool = False,
        key_watch: KeyWatch | None = None,
    ) -> AsyncGenerator[gateway_pb2.StreamRunResponse, None]:
        """A run's stream: snapshot, log after `after_seq`, live tail; ends after a terminal
        event. Raises NotFound for an absent run and for one the viewer may not see (the same
        answer), and Unauthenticated once `key_watch` finds the caller's key revoked or expired."""
        if after_seq < 0:
            raise InvalidArgument("after_seq must not be negative")
        if not is_identifier(run_id, max_length=128):
            raise NotFound(f"run {run_id!r} not found")
        feed = self.hub.open(deltas=include_deltas)
        batched = batch_catch_up
        try:  # one generator, not two: every layer costs each message of every stream
            loop = asyncio.get_running_loop()
            await self.hub.follow(feed, run_id)
            first = await self.read(viewer, run_id, after_seq, include_state=True)
            if after_seq > first.run.last_seq:
                raise InvalidArgument(
                    f"after_seq {after_seq} is beyond the run's last event ({first.run.last_seq})"
                )
            yield gateway_pb2.StreamRunResponse(
                snapshot=gateway_pb2.RunSnapshot(run=first.run, parts=first.parts)
            )
            cursor = RunCursor(run_id, after_seq, first.run.status)
            async for page in self.log_pages(viewer, run_id, after_seq, first):
                for response in _catch_up_responses(page, cursor, batched):
                    yield response
            if cursor.ended or first.run.status in TERMINAL_STATUSES:
                return
            quiet_since = checked_at = loop.time()
            while True:
                now = loop.time()
                live = self.hub.is_live(run_id)
                wait = self.wait_time(live, quiet_since, checked_at, now)
                item = await feed.next(key_watch.bound(wait) if key_watch else wait)
                if key_watch is not None:
                    await key_watch.verify_if_due()
                if item in (Signal.OVERFLOWED, Signal.CLOSED):
                    error = SlowConsumer if item is Signal.OVERFLOWED else StreamInterrupted
                    resume = str(cursor.seq)
                    raise resumable(error, RESUME_SEQ_KEY, resume, f"after_seq={resume}")
                reread = item is Signal.RESYNC
                if item is None:
                    now = loop.time()
                    reread = not live or now - checked_at >= self.timing.keepalive_s
                elif not isinstance(item, LiveEvent):
                    pass
                elif item.seq and item.seq <= cursor.seq:
                    pass  # already delivered (from PostgreSQL, or published twice)
                elif item.seq in (0, cursor.seq + 1) and live_proto(item) is not None:
                    cursor.accept(item.seq, item.type)
                    yield item.memo(_GRPC_RUN, _run_response)
                    quiet_since = loop.time()
                else:
                    reread = True  # a gap: Redis lost what came between
                if reread:
                    checked_at = loop.time()
                    async for page in self.log_pages(viewer, run_id, cursor.seq):
                        for response in _catch_up_responses(page, cursor, batched):
                            yield response
                            quiet_since = loop.time()
                if cursor.ended:
                    return
                if loop.time() - quiet_since >= self.timing.keepalive_s:
                    yield gateway_pb2.StreamRunResponse(event=keepalive(run_id, cursor.status))
                    quiet_since = loop.time()
        finally:
            self.hub.close(feed)


_GRPC_RUN = "grpc-run"
# A batch stays well under the 4 MiB a gRPC client accepts by default.
MAX_BATCH_BYTES = 1 << 20


def _catch_up_responses(
    page: Sequence[events_pb2.RunEvent], cursor: RunCursor, batched: bool
) -> Iterator[gateway_pb2.StreamRunResponse]:
    """The responses carrying a page's new events: one each, or batches of consecutive ones."""
    fresh = [event for event in page if cursor.accept(event.seq, event.type)]
    if not batched:
        for event in fresh:
            yield gateway_pb2.StreamRunResponse(event=event)
        return
    start, size = 0, 0
    for i, event in enumerate(fresh):
        size += event.ByteSize()
        if size > MAX_BATCH_BYTES and i > start:
            yield gateway_pb2.StreamRunResponse(
                batch=gateway_pb2.RunEventBatch(events=fresh[start:i])
            )
            start, size = i, event.ByteSize()
    if start < len(fresh):
        yield gateway_pb2.StreamRunResponse(batch=gateway_pb2.RunEventBatch(events=fresh[start:]))


def _run_response(live: LiveEvent) -> gateway_pb2.StreamRunResponse:
    return gateway_pb2.StreamRunResponse(event=live.event)


TERMINAL_STATUSES = frozenset(
    {common_pb2.RUN_STATUS_COMPLETED, common_pb2.RUN_STATUS_FAILED, common_pb2.RUN_STATUS_CANCELLED}
)
