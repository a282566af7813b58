"""The shared Supervisor: a background task that raises, or returns while the service is not
stopping, takes the service down loudly; a cancelled one, or one that finishes its work once the
service is stopping, does not."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tether.runtime.tasks import Supervisor


async def crash() -> None:
    raise RuntimeError("a bug")


async def finish() -> None:
    return None


async def forever() -> None:
    await asyncio.Event().wait()


async def test_a_task_that_raises_stops_the_service_loudly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    supervisor = Supervisor()
    supervisor.start("crasher", crash())
    await asyncio.wait_for(supervisor.failed.wait(), 5)
    assert "background task crasher died: RuntimeError('a bug')" in caplog.text
    assert caplog.records[-1].levelno == logging.CRITICAL
    with pytest.raises(RuntimeError, match="a bug"):
        await supervisor.stop()


async def test_a_task_that_returns_unasked_has_died() -> None:
    supervisor = Supervisor()
    supervisor.start("quitter", finish())
    await asyncio.wait_for(supervisor.failed.wait(), 5)
    await supervisor.stop()


async def test_a_task_that_finishes_once_stopping_or_is_cancelled_has_not_died(
    caplog: pytest.LogCaptureFixture,
) -> None:
    drained = asyncio.Event()

    async def pool() -> None:  # runs until its own stop drains it, as the worker's pool does
        await drained.wait()

    supervisor = Supervisor()
    supervisor.start("loop", forever())
    supervisor.start("pool", pool())
    supervisor.stopping()
    drained.set()
    await asyncio.wait_for(supervisor.tasks[1], 5)
    await supervisor.stop()
    assert all(task.done() for task in supervisor.tasks)
    assert not supervisor.failed.is_set()
    assert "died" not in caplog.text
