"""The attempt's view of its run's transcript: parts, pending events and unpersisted turns.

Parts are domain Parts (frozen); one still streaming is a draft (`services.worker.drafts`) that
becomes a Part when a checkpoint takes it or its block ends. A checkpoint sends only what
changed since the last one, so its cost follows the new parts, never the history.

A streaming part's snapshot is stored whole each time a checkpoint carries it, so carrying a long
one at every checkpoint stored it over and over: an answer's writes grew with its length times
its duration (24,000 characters streamed for 12 s wrote 498 kB of WAL, 21 bytes per character;
`make bench BENCH=hotpath`, wal_bytes_per_answer_char). A short one (under SMALL_SNAPSHOT
characters) goes with every checkpoint; a longer one once it has grown by a quarter
(SNAPSHOT_GROWTH) since it was last taken, so its snapshots add up to about five times its final
size, however long it streams (147 kB, 6 bytes per character). Its block's end, and a checkpoint
that must carry everything (`take(whole=True)`), always carry it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TypeVar

from services.worker.drafts import Draft
from tether.domain import (
    Batch,
    Content,
    Event,
    Interruption,
    ModelTurn,
    Part,
    Role,
    Text,
    ToolCall,
    dangling_tool_calls,
    interrupted_results,
    part_added,
    part_updated,
)

D = TypeVar("D", bound=Draft)

SMALL_SNAPSHOT = 2048  # characters: about where PostgreSQL starts storing a value out of line
SNAPSHOT_GROWTH = 1.25


class Transcript:
    """Parts of the current run, and what the next checkpoint must carry."""

    def __init__(self, own_parts: Sequence[Part]) -> None:
        self._parts: list[Part] = list(own_parts)
        self._open: dict[int, tuple[int, Draft]] = {}  # part index -> (position, draft)
        self._dirty: dict[int, Part | Draft] = {}
        self._events: list[Event] = []
        # Parts whose part.added is still pending: index -> its position in `_events`.
        self._announced: dict[int, int] = {}
        self._turns: list[ModelTurn] = []
        # Open parts' sizes when a checkpoint last took them: index -> size.
        self._taken: dict[int, int] = {}
        self.last_flush = time.monotonic()
        # When the attempt last made progress: a model event, or a write that landed.
        self.progressed_at = self.last_flush

    @property
    def parts(self) -> Sequence[Part]:
        """Every part of the run, one still streaming as it stands."""
        for _, draft in self._open.values():
            self._snapshot(draft)
        return self._parts

    @property
    def next_index(self) -> int:
        """Index the next part gets."""
        return (self._parts[-1].index + 1) if self._parts else 0

    def add(self, role: str, content: Content) -> Part:
        """Append a whole part (final), announced with part.added."""
        self.progressed_at = time.monotonic()
        part = Part(self.next_index, role, content, final=True)
        self._parts.append(part)
        self._dirty[part.index] = part
        self._events.append(part_added(part))
        return part

    def append_stored(self, part: Part) -> None:
        """Append a part already stored with its events (a compaction summary): the next
        checkpoint does not carry it."""
        self.progressed_at = time.monotonic()
        self._parts.append(part)

    def open(self, draft: D) -> D:
        """Append a part that streams, announced with part.added as it starts."""
        self.progressed_at = time.monotonic()
        draft.index = self.next_index
        part = draft.freeze(final=False)
        self._open[part.index] = (len(self._parts), draft)
        self._parts.append(part)
        self._dirty[part.index] = draft
        self._announced[part.index] = len(self._events)
        self._events.append(part_added(part))
        return draft

    def touch(self, draft: Draft) -> None:
        """The draft grew: the next checkpoint carries it."""
        self.progressed_at = time.monotonic()
        self._dirty[draft.index] = draft

    def finish(self, draft: Draft) -> Part:
        """The draft's block ended: its final part, announced with part.updated, or, when its
        part.added has not gone yet, by that part.added carrying the final part (both events
        carry the part whole, so a client applies either the same way, and a block that
        starts and ends between two checkpoints costs one event, not two)."""
        self.progressed_at = time.monotonic()
        part = draft.freeze(final=True)
        self._taken.pop(draft.index, None)
        position, _ = self._open.pop(draft.index)
        self._parts[position] = part
        self._dirty[part.index] = part
        pending = self._announced.pop(part.index, None)
        if pending is None:
            self._events.append(part_updated(part))
        else:
            self._events[pending] = part_added(part)
        return part

    def record(self, *events: Event) -> None:
        """Events for the next checkpoint, in order."""
        self._events.extend(events)

    def record_turn(self, turn: ModelTurn) -> None:
        """A model turn's usage, for the next checkpoint."""
        self._turns.append(turn)

    def take(self, number: int, *, whole: bool = False) -> Batch:
        """What changed since the last checkpoint, as batch `number`: everything when `whole`,
        else all but the streaming parts whose snapshot can wait (see the module's note);
        resets what it takes."""
        taken = {i: p for i, p in self._dirty.items() if whole or self._due(p)}
        parts = tuple(self._snapshot(p) if isinstance(p, Draft) else p for p in taken.values())
        for item in taken.values():
            if isinstance(item, Draft):
                self._taken[item.index] = item.size
        batch = Batch(number, parts, tuple(self._events), tuple(self._turns))
        self._dirty = {i: p for i, p in self._dirty.items() if i not in taken}
        self._events, self._turns = [], []
        self._announced = {}
        self.last_flush = time.monotonic()
        return batch

    def _due(self, item: Part | Draft) -> bool:
        """Whether a routine checkpoint carries `item` now: a whole part always; a streaming
        one the first time, then when its snapshot grew, at every checkpoint while it is short
        and by a quarter once it is long."""
        if not isinstance(item, Draft):
            return True
        taken = self._taken.get(item.index)
        if taken is None:
            return True
        size = item.size
        return size > taken and (size < SMALL_SNAPSHOT or size >= taken * SNAPSHOT_GROWTH)

    @property
    def due(self) -> bool:
        """Whether a routine checkpoint would carry anything now."""
        return bool(self._events or self._turns or any(map(self._due, self._dirty.values())))

    def checkpoint_due(self, interval_s: float) -> bool:
        """Whether a routine checkpoint should go now: `interval_s` since the last one and
        something due. When the interval passed with nothing due (a long part waiting to grow
        by a quarter), it starts again, so the question costs little between checkpoints."""
        now = time.monotonic()
        if now - self.last_flush < interval_s:
            return False
        if self.due:
            return True
        self.last_flush = now
        return False

    def _snapshot(self, draft: Draft) -> Part:
        part = draft.freeze(final=False)
        self._parts[self._open[draft.index][0]] = part
        return part

    @property
    def pending(self) -> bool:
        """Whether anything awaits a checkpoint (a snapshot that can wait included)."""
        return bool(self._dirty or self._events or self._turns)

    def dangling_tool_calls(self) -> list[ToolCall]:
        """Whole tool calls of this run with no result yet (see `tether.domain`)."""
        return [
            p.content for p in dangling_tool_calls(self.parts) if isinstance(p.content, ToolCall)
        ]

    def close_dangling(self, reason: Interruption, *, keep: frozenset[str] = frozenset()) -> None:
        """Close every open tool call (but those named in `keep`, which the next attempt
        issues again) with an interrupted error result saying why."""
        results, events = interrupted_results(self.parts, reason, self.next_index, keep=keep)
        for part in results:
            self._parts.append(part)
            self._dirty[part.index] = part
        self._events.extend(events)

    def final_text(self, since: int) -> str:
        """Assistant text of the parts from index `since` on."""
        return "".join(
            p.content.text
            for p in self.parts
            if p.index >= since and p.role == Role.ASSISTANT and isinstance(p.content, Text)
        )
