"""What a worker holds of its sessions' histories between leases on one Work stream, LRU by
bytes within the budget its hello announced. One rule for both ends: the orchestrator keeps a
mirror of it per stream (to send only what the worker lacks, and to tell it what to forget),
and the worker keeps the histories themselves; the same operations in the same order leave both
holding the same sessions."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Held(Generic[T]):
    """One session's history as held, and its size (the serialized bytes of its parts)."""

    value: T
    size: int


class HeldHistories(Generic[T]):
    """Sessions' histories by session id, least recently used first, never more than
    `budget_bytes` in all."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._held: OrderedDict[str, Held[T]] = OrderedDict()
        self.size = 0

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._held

    def peek(self, session_id: str) -> T | None:
        """The session's history, if held, without counting it as used."""
        held = self._held.get(session_id)
        return None if held is None else held.value

    def use(self, session_id: str) -> T | None:
        """The session's history, if held, now its most recently used."""
        held = self._held.get(session_id)
        if held is None:
            return None
        self._held.move_to_end(session_id)
        return held.value

    def keep(self, session_id: str, value: T, size: int) -> list[str]:
        """Hold `value` as the session's history (replacing what was), most recently used; the
        sessions evicted to stay within the budget, least recently used first (the session
        itself when it alone is over the budget: then nothing of it is held)."""
        self.forget(session_id)
        if size > self.budget_bytes:
            return [session_id]
        evicted = []
        while self.size + size > self.budget_bytes:
            oldest, held = self._held.popitem(last=False)
            self.size -= held.size
            evicted.append(oldest)
        self._held[session_id] = Held(value, size)
        self.size += size
        return evicted

    def forget(self, session_id: str) -> bool:
        """Hold nothing of the session; whether something was held."""
        held = self._held.pop(session_id, None)
        if held is None:
            return False
        self.size -= held.size
        return True

    def clear(self) -> None:
        """Hold nothing (a new stream: the other end's mirror starts empty)."""
        self._held.clear()
        self.size = 0
