"""The streaming pieces that need no server: feeds, cursors, catch-up batches."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.live.conversation import ConversationCursor
from services.gateway.live.hub import Feed, LiveEvent, Signal
from services.gateway.live.streams import MAX_BATCH_BYTES, RunCursor, _catch_up_responses
from tether.errors import InvalidArgument
from tether.hints import LiveMessage
from tether.v1 import common_pb2, events_pb2


def live(seq: int) -> LiveEvent:
    return LiveEvent(LiveMessage("run_1", seq, "run.checkpointed", {}))


def checkpointed(seq: int, padding: int = 0) -> events_pb2.RunEvent:
    event = events_pb2.RunEvent(run_id="run_1", seq=seq, type="part.updated")
    event.part_updated.part.text.text = "x" * padding
    return event


async def test_a_full_feed_overflows_instead_of_waiting() -> None:
    feed = Feed(2, deltas=False)
    assert feed.offer(live(1)) and feed.offer(live(2))
    assert not feed.offer(live(3)), "the publisher never waits on a subscriber"
    assert await feed.next(1.0) is Signal.OVERFLOWED, "overflow overtakes what is buffered"


async def test_signals_overtake_buffered_events_and_a_resync_is_seen_once() -> None:
    feed = Feed(8, deltas=False)
    feed.offer(live(1))
    feed.signal(Signal.RESYNC)
    assert await feed.next(1.0) is Signal.RESYNC
    first = await feed.next(1.0)
    assert isinstance(first, LiveEvent) and first.seq == 1
    assert await feed.next(0.05) is None, "the queued wake-up of a handled resync is skipped"
    feed.signal(Signal.CLOSED)
    assert await feed.next(1.0) is Signal.CLOSED


async def test_next_waits_for_an_event_and_times_out_quietly() -> None:
    feed = Feed(8, deltas=True)
    asyncio.get_running_loop().call_later(0.02, feed.offer, live(7))
    item = await feed.next(5.0)
    assert isinstance(item, LiveEvent) and item.event.seq == 7
    assert await feed.next(0.01) is None


def test_a_live_event_decodes_once_and_memoises_encodings() -> None:
    event = live(3)
    calls = []

    def encode(e: LiveEvent) -> int:
        calls.append(e)
        return e.seq

    assert event.memo("k", encode) == 3 and event.memo("k", encode) == 3
    assert len(calls) == 1


def test_the_run_cursor_drops_duplicates_and_tracks_status() -> None:
    cursor = RunCursor("run_1", 2, common_pb2.RUN_STATUS_QUEUED)
    assert not cursor.accept(2, "run.started")
    assert cursor.accept(3, "run.started") and cursor.status == common_pb2.RUN_STATUS_RUNNING
    assert cursor.accept(4, "run.retry-pending")
    assert cursor.status == common_pb2.RUN_STATUS_RETRY_PENDING and not cursor.ended
    assert cursor.accept(5, "run.completed") and cursor.ended


def test_catch_up_batches_stay_under_the_size_cap_and_skip_what_was_sent() -> None:
    big = MAX_BATCH_BYTES // 3
    page = [checkpointed(seq, big) for seq in range(1, 8)]
    cursor = RunCursor("run_1", 1, common_pb2.RUN_STATUS_RUNNING)
    batches = list(_catch_up_responses(page, cursor, batched=True))
    seqs = [e.seq for b in batches for e in b.batch.events]
    assert seqs == [2, 3, 4, 5, 6, 7]
    assert all(b.ByteSize() <= MAX_BATCH_BYTES + 100 for b in batches)
    assert len(batches) == 3
    single = list(_catch_up_responses(page, RunCursor("run_1", 5, 0), batched=False))
    assert [r.event.seq for r in single] == [6, 7]


def test_conversation_cursors_round_trip_and_refuse_forgeries() -> None:
    cursor = ConversationCursor((1_700_000_000_000_000, "run_a"), {"run_b": 4, "run_c": 1})
    assert ConversationCursor.decode(cursor.encode()) == cursor
    assert ConversationCursor.decode("") == ConversationCursor()
    for forged in ("not-base64!", "e30", cursor.encode()[:-3] + "abc"):
        with pytest.raises(InvalidArgument):
            ConversationCursor.decode(forged)
