"""What an attempt writes under its lease: numbered batches of progress, then its completion."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from tether.domain.events import Event
from tether.domain.outcomes import Ending, ModelTurn
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


@dataclass(frozen=True)
class Completion:
    """What a worker reports when an attempt ends: how it ended, what the checkpoint writer had
    not yet written (and the batch it had in flight), the stage timings and the audit detail."""

    ending: Ending
    parts: Sequence[Part] = ()
    events: Sequence[Event] = ()
    turns: Sequence[ModelTurn] = ()
    stages: dict[str, float] = field(default_factory=dict)
    audit: dict[str, Any] = field(default_factory=dict)
    in_flight: Batch | None = None


class EffectState(StrEnum):
    """The state of a side effect's record as opening it found it (the orchestrator stores it;
    the worker's tool registry acts on it)."""

    BEGUN = "begun"
    IN_PROGRESS = "in-progress"
    DONE = "done"
