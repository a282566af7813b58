"""StreamConversation: every run of one conversation in a single stream, with one cursor.

Each run is followed exactly as StreamRun follows it (subscribe, read PostgreSQL after its
position, tail live, re-read on a gap); new runs are discovered by listing the conversation's
runs every `conversation_poll_s`.

The cursor is base64url of compact JSON `{"v": 1, "w": [created_us, run_id] | null,
"r": {run_id: seq}}`. The watermark `w` stands for every run created at or before it: each was
finished and delivered to its end. `r` holds the position in every later run. The watermark
moves past a finished run only once that run is older than `WATERMARK_HORIZON_S`, so the cursor
stays small however long the conversation grows.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.gateway.live.hub import Feed, LiveEvent, Signal
from services.gateway.live.streams import (
    TERMINAL_STATUSES,
    RunCursor,
    SlowConsumer,
    StreamInterrupted,
    Streams,
    keepalive,
    live_proto,
    resumable,
)
from tether.errors import InvalidArgument
from tether.ids import is_identifier
from tether.limits import INT64_MAX
from tether.transport import RESUME_CURSOR_KEY
from tether.v1 import common_pb2, events_pb2, gateway_pb2, orchestrator_pb2
from tether.visibility import Viewer

if TYPE_CHECKING:
    from services.gateway.auth import KeyWatch

CURSOR_VERSION = 1
# Admission stamps created_at when its transaction starts, so two runs of one conversation can
# commit out of created_at order, by at most one transaction's length. A minute is far beyond
# that: the watermark never passes a run that might still appear below it.
WATERMARK_HORIZON_S = 60.0
_SEARCH_PAGE = 200  # the orchestrator's largest page

RunKey = tuple[int, str]  # (created_at in microseconds, run_id): the order runs were created in


@dataclass
class ConversationCursor:
    """Where a conversation stream stands."""

    watermark: RunKey | None = None
    seqs: dict[str, int] = field(default_factory=dict)

    def encode(self) -> str:
        """The opaque form clients hold."""
        data = {
            "v": CURSOR_VERSION,
            "w": list(self.watermark) if self.watermark else None,
            "r": self.seqs,
        }
        raw = json.dumps(data, separators=(",", ":"), sort_keys=True).encode()
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")

    @classmethod
    def decode(cls, text: str) -> ConversationCursor:
        """Parse a cursor this service issued; empty means the start of the conversation."""
        if not text:
            return cls()
        try:
            raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
            data = json.loads(raw)
            if data.get("v") != CURSOR_VERSION:
                raise ValueError("unknown cursor version")
            mark = data.get("w")
            watermark = (int(mark[0]), str(mark[1])) if mark else None
            seqs = {str(k): int(v) for k, v in dict(data.get("r") or {}).items()}
        except (
            ValueError,
            TypeError,
            KeyError,
            IndexError,
            binascii.Error,
            AttributeError,
            RecursionError,
        ) as exc:
            raise InvalidArgument("cursor is not one this service issued") from exc
        # A hand-made cursor could name ids or seqs no issued one holds (and PostgreSQL or
        # protobuf refuses): out of range is as forged as undecodable.
        run_ids = [*seqs, *([watermark[1]] if watermark else [])]
        if any(not 0 <= seq <= INT64_MAX for seq in seqs.values()) or not all(
            is_identifier(run_id) for run_id in run_ids
        ):
            raise InvalidArgument("cursor is not one this service issued")
        if watermark is not None and not 0 <= watermark[0] <= INT64_MAX:
            raise InvalidArgument("cursor is not one this service issued")
        return cls(watermark, seqs)


@dataclass
class _Track:
    key: RunKey
    cursor: RunCursor


def _key(run: common_pb2.Run) -> RunKey:
    return (run.created_at.ToMicroseconds(), run.run_id)


async def conversation_items(
    streams: Streams,
    viewer: Viewer,
    conversation_id: str,
    cursor: str,
    *,
    include_deltas: bool,
    key_watch: KeyWatch | None = None,
) -> AsyncGenerator[gateway_pb2.StreamConversationResponse, None]:
    """Every event of every run of the conversation after `cursor`, then the live tail.

    The stream never ends by itself (but with Unauthenticated once `key_watch` finds the
    caller's key revoked or expired): a conversation can always take another message. Runs the
    viewer may not see (another tenant's, another principal's) are not in it: a conversation
    of only those looks like one with no runs yet.
    """
    if not conversation_id:
        raise InvalidArgument("conversation_id is required")
    position = ConversationCursor.decode(cursor)
    feed = streams.hub.open(deltas=include_deltas)
    conversation = _Conversation(streams, viewer, conversation_id, position, feed, key_watch)
    try:
        async with aclosing(conversation.items()) as items:
            async for item in items:
                yield item
    finally:
        streams.hub.close(feed)


class _Conversation:
    def __init__(
        self,
        streams: Streams,
        viewer: Viewer,
        conversation_id: str,
        position: ConversationCursor,
        feed: Feed,
        key_watch: KeyWatch | None = None,
    ) -> None:
        self._streams = streams
        self._hub = streams.hub
        self._viewer = viewer
        self._conversation_id = conversation_id
        self._watermark = position.watermark
        self._initial = dict(position.seqs)
        self._feed = feed
        self._tracks: dict[str, _Track] = {}
        self._key_watch = key_watch

    # -- the cursor -----------------------------------------------------------------------------

    def cursor(self) -> str:
        """The resumable cursor as of what was delivered, including the positions this
        connection was given for runs it has not reached yet (dropping those would replay them
        from the start after the next reconnect)."""
        seqs = dict(self._initial)
        seqs.update({rid: t.cursor.seq for rid, t in self._tracks.items() if t.cursor.seq})
        return ConversationCursor(self._watermark, seqs).encode()

    def _response(self, event: events_pb2.RunEvent) -> gateway_pb2.StreamConversationResponse:
        return gateway_pb2.StreamConversationResponse(event=event, cursor=self.cursor())

    def _compact(self) -> None:
        """Fold the oldest finished runs into the watermark."""
        horizon = int((time.time() - WATERMARK_HORIZON_S) * 1_000_000)
        for run_id, track in sorted(self._tracks.items(), key=lambda item: item[1].key):
            if not track.cursor.ended or track.key[0] > horizon:
                return
            self._watermark = track.key
            del self._tracks[run_id]

    # -- runs -----------------------------------------------------------------------------------

    async def _discover(self) -> list[common_pb2.Run]:
        """Runs of the conversation not followed yet, oldest first."""
        found: list[common_pb2.Run] = []
        horizon = int((time.time() - WATERMARK_HORIZON_S) * 1_000_000)
        token = ""
        while True:
            page: orchestrator_pb2.SearchRunsResponse = await self._streams.orchestrator.SearchRuns(
                orchestrator_pb2.SearchRunsRequest(
                    **self._viewer.fields(),
                    conversation_id=self._conversation_id,
                    page_size=_SEARCH_PAGE,
                    page_token=token,
                )
            )
            for run in page.runs:
                key = _key(run)
                if self._watermark is not None and key <= self._watermark:
                    return sorted(found, key=_key)
                if run.run_id not in self._tracks:
                    found.append(run)
                elif key[0] < horizon:
                    # Known, and old enough that nothing older can still be appearing.
                    return sorted(found, key=_key)
            if not page.next_page_token:
                return sorted(found, key=_key)
            token = page.next_page_token

    async def _open(
        self, runs: list[common_pb2.Run]
    ) -> AsyncGenerator[gateway_pb2.StreamConversationResponse, None]:
        for run in runs:
            cursor = RunCursor(run.run_id, self._initial.pop(run.run_id, 0), run.status)
            self._tracks[run.run_id] = _Track(_key(run), cursor)
            if run.status in TERMINAL_STATUSES and cursor.seq >= run.last_seq:
                cursor.ended = True  # delivered to its end before this connection
                continue
            await self._hub.follow(self._feed, run.run_id)
            async for item in self._catch_up(self._tracks[run.run_id]):
                yield item

    async def _catch_up(
        self, track: _Track
    ) -> AsyncGenerator[gateway_pb2.StreamConversationResponse, None]:
        cursor = track.cursor
        async for event in self._streams.log_after(self._viewer, cursor.run_id, cursor.seq):
            if cursor.accept(event.seq, event.type):
                yield self._response(event)
        if cursor.ended:
            self._hub.unfollow(self._feed, cursor.run_id)

    def _open_tracks(self) -> list[_Track]:
        return sorted((t for t in self._tracks.values() if not t.cursor.ended), key=lambda t: t.key)

    def _keepalive(self) -> gateway_pb2.StreamConversationResponse:
        newest = max(self._tracks.values(), key=lambda t: t.key, default=None)
        if newest is None:
            return self._response(keepalive("", common_pb2.RUN_STATUS_UNSPECIFIED))
        return self._response(keepalive(newest.cursor.run_id, newest.cursor.status))

    # -- the stream -----------------------------------------------------------------------------

    async def items(self) -> AsyncGenerator[gateway_pb2.StreamConversationResponse, None]:
        loop = asyncio.get_running_loop()
        timing = self._streams.timing
        async for item in self._open(await self._discover()):
            yield item
        self._compact()
        quiet_since = checked_at = discovered_at = loop.time()
        while True:
            now = loop.time()
            live = all(self._hub.is_live(t.cursor.run_id) for t in self._open_tracks())
            wait = min(
                self._streams.wait_time(live, quiet_since, checked_at, now),
                max(timing.conversation_poll_s - (now - discovered_at), 0.01),
            )
            watch = self._key_watch
            signal = await self._feed.next(watch.bound(wait) if watch else wait)
            if watch is not None:
                await watch.verify_if_due()
            if signal in (Signal.OVERFLOWED, Signal.CLOSED):
                error = SlowConsumer if signal is Signal.OVERFLOWED else StreamInterrupted
                raise resumable(error, RESUME_CURSOR_KEY, self.cursor(), "the last cursor")
            stale: list[_Track] = []
            if signal is Signal.RESYNC:
                stale = self._open_tracks()
            elif signal is None:
                now = loop.time()
                if now - discovered_at >= timing.conversation_poll_s:
                    discovered_at = now
                    async for item in self._open(await self._discover()):
                        yield item
                        quiet_since = loop.time()
                if not live or now - checked_at >= timing.keepalive_s:
                    stale = self._open_tracks()
            elif isinstance(signal, LiveEvent):
                track = self._tracks.get(signal.run_id)
                if track is None or track.cursor.ended:
                    pass
                elif signal.seq and signal.seq <= track.cursor.seq:
                    pass  # already delivered
                elif signal.seq in (0, track.cursor.seq + 1) and live_proto(signal) is not None:
                    track.cursor.accept(signal.seq, signal.type)
                    yield self._response(signal.event)
                    quiet_since = loop.time()
                    if track.cursor.ended:
                        self._hub.unfollow(self._feed, track.cursor.run_id)
                else:
                    stale = [track]  # a gap: re-read this run from PostgreSQL
            if stale:
                checked_at = loop.time()
                for track in stale:
                    async for item in self._catch_up(track):
                        yield item
                        quiet_since = loop.time()
            self._compact()
            if loop.time() - quiet_since >= timing.keepalive_s:
                yield self._keepalive()
                quiet_since = loop.time()
