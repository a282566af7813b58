"""`tether.runtime.tasks.rounds`: a round runs again when its work says it is next due, never
sooner than the least wait nor later than the most, and at once when nudged; a failed round is
tried again after the least wait. Timed on the real event loop clock: a wait is never shorter
than asked, and the bounds above are loose enough for a loaded machine yet tell each case
from the others."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable

from tether.runtime.tasks import rounds


class Work:
    """Answers each round with the next of `answers` (an exception is raised), and records
    when each round began."""

    def __init__(self, *answers: float | Exception | None) -> None:
        self._answers = list(answers)
        self.began: list[float] = []
        self.first = asyncio.Event()
        self.enough = asyncio.Event()

    async def __call__(self) -> float | None:
        self.began.append(asyncio.get_running_loop().time())
        self.first.set()
        answer = self._answers.pop(0) if self._answers else None
        if not self._answers:
            self.enough.set()
        if isinstance(answer, Exception):
            raise answer
        return answer

    def gaps(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.began)]


@contextlib.asynccontextmanager
async def running(make: Callable[[], object]) -> AsyncIterator[None]:
    task = asyncio.ensure_future(make())  # type: ignore[arg-type]
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_the_next_round_comes_when_due_within_the_least_and_the_most_wait() -> None:
    # Due in 0.2 s, then overdue (waits the least, 0.05 s), then nothing known (the most, 0.6 s).
    work = Work(0.2, -1.0, None, None)
    async with running(lambda: rounds(work, "t", least_s=0.05, most_s=0.6)):
        await asyncio.wait_for(work.enough.wait(), 10)
    due, overdue, unknown = work.gaps()
    assert 0.2 <= due < 0.55
    assert 0.05 <= overdue < 0.2
    assert unknown >= 0.6


async def test_a_nudge_starts_a_round_at_once_and_a_failed_round_is_tried_after_the_least() -> None:
    nudge = asyncio.Event()
    work = Work(None, RuntimeError("a round failed"), None)
    async with running(lambda: rounds(work, "t", least_s=0.1, most_s=60.0, nudge=nudge)):
        await asyncio.wait_for(work.first.wait(), 10)
        nudge.set()  # the round would otherwise wait its 60 s
        await asyncio.wait_for(work.enough.wait(), 10)
    nudged, after_failure = work.gaps()
    assert nudged < 5.0, "not the 60 s the round would have waited"
    assert 0.1 <= after_failure < 5.0
