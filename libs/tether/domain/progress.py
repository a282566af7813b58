"""What an attempt writes under its lease: a numbered batch of progress."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tether.domain.events import Event
from tether.domain.outcomes import ModelTurn
from tether.domain.parts import Part


@dataclass(frozen=True, slots=True)
class Batch:
    """What changed since the previous batch: the parts as they stand now, and the events and
    model turns in the order they were recorded. `number` counts the checkpoints sent under
    the lease, so a batch sent twice lands once (0: not a checkpoint, the rest a completion
    carries)."""

    number: int
    parts: Sequence[Part] = ()
    events: Sequence[Event] = ()
    turns: Sequence[ModelTurn] = ()
