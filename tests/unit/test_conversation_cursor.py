"""A conversation stream's cursor keeps the position of every run, reached or not yet."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from services.gateway.live.conversation import ConversationCursor, _Conversation, _Track
from services.gateway.live.streams import RunCursor
from tether.errors import InvalidArgument
from tether.v1 import common_pb2


def test_a_reconnect_that_has_not_reached_a_run_yet_keeps_that_runs_position() -> None:
    given = ConversationCursor(watermark=None, seqs={"run_a": 5, "run_b": 3})
    streams: Any = SimpleNamespace(hub=None)  # only the cursor arithmetic is exercised here
    conversation = _Conversation(streams, "tenant", "conv", given, feed=None)  # type: ignore[arg-type]
    # The reconnect has caught up run_a by one event and not opened run_b yet.
    cursor = RunCursor("run_a", conversation._initial.pop("run_a"), common_pb2.RUN_STATUS_RUNNING)
    cursor.accept(6, "part.added")
    conversation._tracks["run_a"] = _Track((1, "run_a"), cursor)
    assert ConversationCursor.decode(conversation.cursor()).seqs == {"run_a": 6, "run_b": 3}


def test_the_cursor_round_trips_and_refuses_what_it_did_not_issue() -> None:
    cursor = ConversationCursor(watermark=(123, "run_z"), seqs={"run_a": 2})
    assert ConversationCursor.decode(cursor.encode()) == cursor
    for bad in ("not base64!", "e30", ConversationCursor(seqs={"r": -1}).encode()):
        with pytest.raises(InvalidArgument):
            ConversationCursor.decode(bad)
