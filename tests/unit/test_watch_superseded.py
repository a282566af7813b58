"""`tether watch` on a terminal cannot take back what it printed: on part.superseded it says the
cut-off output does not count, and prints nothing more of that part."""

from __future__ import annotations

import io
from typing import Any

from tether.cli.watch import Renderer
from tether.v1 import common_pb2, events_pb2


def delta(index: int, text: str, offset: int) -> events_pb2.RunEvent:
    event = events_pb2.RunEvent(type="text.delta")
    event.text_delta.part_index, event.text_delta.text, event.text_delta.offset = (
        index,
        text,
        offset,
    )
    return event


def superseded(index: int, attempt: int) -> events_pb2.RunEvent:
    event = events_pb2.RunEvent(type="part.superseded")
    event.part_superseded.part_index, event.part_superseded.attempt = index, attempt
    return event


def added(index: int, text: str) -> events_pb2.RunEvent:
    event = events_pb2.RunEvent(type="part.added")
    event.part_added.part.CopyFrom(
        common_pb2.Part(
            index=index, role="assistant", final=True, text=common_pb2.TextPart(text=text)
        )
    )
    return event


async def test_a_superseded_part_is_disowned_once_and_never_printed_again() -> None:
    out = io.StringIO()
    client: Any = None  # only pauses ask the gateway
    renderer = Renderer(client, "run_x", out)
    for event in (
        delta(0, "Hello wor", 0),
        superseded(0, 1),
        delta(0, "ld", 9),  # late: it left before the notice, arrived after it
        added(1, "Hello world."),
        superseded(2, 1),  # a part this terminal never showed: nothing to say
    ):
        await renderer.event(event)
    renderer.close()
    assert out.getvalue().splitlines() == [
        "Hello wor",
        "[superseded] attempt 1 was cut off: the next attempt answers again",
        "Hello world.",
    ]
