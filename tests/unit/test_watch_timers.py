"""`tether watch` says when a run parks on its timer and when it wakes."""

from __future__ import annotations

import io
from typing import Any

from tether.cli.watch import Renderer
from tether.v1 import events_pb2


async def test_a_timer_is_shown_waiting_then_woken() -> None:
    out = io.StringIO()
    client: Any = None  # only pauses for a person ask the gateway
    renderer = Renderer(client, "run_x", out)
    parked = events_pb2.RunEvent(type="timer.set")
    parked.timer_set.tool_call_id = "toolu_1"
    parked.timer_set.due_at.FromJsonString("2026-12-05T10:00:00Z")
    fired = events_pb2.RunEvent(type="timer.fired")
    fired.timer_fired.due_at.FromJsonString("2026-12-05T10:00:00Z")
    for event in (parked, fired):
        await renderer.event(event)
    renderer.close()
    assert out.getvalue().splitlines() == [
        "[timer] waiting until 2026-12-05T10:00:00Z, holding no worker",
        "[timer] woke (due 2026-12-05T10:00:00Z)",
    ]
