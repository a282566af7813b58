"""Shared model rate limits against the model server enforcing the same limits (issue 32, stage
3): the orchestrator grants each model call's room from its buckets, a run whose call does not
fit waits retry-pending (code rate_limited) and spends no attempt, a worker SIGKILLed mid-call
gives its reservation back, and 429s that still arrive shrink the bucket to what they said.

Every service is a real process; the model server is the local stand-in with its limiter on.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tests.system.execution_support import ExecStack, exec_stack, run_row, wait_for_status
from tether.testing.eventually import eventually
from tether.testing.model_server import RateLimits, Stall, TextTurn

pytestmark = pytest.mark.slow

TERMINAL = ("completed", "failed", "cancelled")


def limits_env(text: str) -> dict[str, str]:
    return {"TETHER_MODEL_LIMITS": text}


async def all_completed(stack: ExecStack, run_ids: list[str], timeout: float) -> None:
    async def done() -> bool | None:
        statuses = [(await run_row(stack.db_url, r)).status for r in run_ids]
        failed = [s for s in statuses if s in ("failed", "cancelled")]
        assert not failed, f"runs ended {failed}"
        return all(s == "completed" for s in statuses) or None

    await eventually(done, timeout=timeout, interval=0.2, what="every run to complete")


def refused(stack: ExecStack, since: float = 0.0) -> int:
    return sum(
        1 for r in stack.model.requests if r.served == "rate_limited" and r.timestamp >= since
    )


async def test_a_fan_out_past_the_limit_completes_with_no_429_after_the_first_window(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path: Path
) -> None:
    # 2 requests a second, pool-wide: 24 runs at once are 12 s of demand.
    window = 2.0
    async with exec_stack(
        pg_server_url,
        template_db,
        redis_url,
        tmp_path,
        workers=2,
        extra_env=limits_env(f"*: requests=4, window={window}"),
        model_limits=RateLimits(requests=4, window=window),
    ) as stack:
        tenant = await stack.tenant(max_attempts=2)
        started = time.time()
        run_ids = await asyncio.gather(*(tenant.send(f"hello number {i}") for i in range(24)))
        await all_completed(stack, list(run_ids), timeout=90)
        answered = [r for r in stack.model.requests if r.served != "rate_limited"]
        assert refused(stack, since=started + window) == 0
        # Two attempts each at most, yet every run completed: a wait spent none of them.
        assert len(answered) == 24
        attempts = [(await run_row(stack.db_url, r)).attempt for r in run_ids]
        # Some run waited for the bucket more often than its attempt budget allows: the
        # waits spent none of it.
        assert max(attempts) > 2, f"the fan-out never waited twice: {attempts}"


async def test_a_worker_killed_mid_call_gives_its_reservation_back_within_a_lease(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path: Path
) -> None:
    # 1000 output tokens per 10 minutes: a 700-token reservation leaves room for no second
    # one for minutes, unless it comes back.
    async with exec_stack(
        pg_server_url,
        template_db,
        redis_url,
        tmp_path,
        workers=0,
        extra_env=limits_env("*: output_tokens=1000, window=600"),
    ) as stack:
        doomed = await stack.start_worker()
        tenant = await stack.tenant(max_tokens_per_turn=700)
        stack.model.script("hold the budget", [TextTurn("late", fault=Stall(after_events=1))])
        held = await tenant.send("hold the budget")
        async with asyncio.timeout(20):
            await stack.model.wait_until(
                lambda log: any(r.script_key == "hold the budget" for r in log)
            )
        await stack.start_worker()  # the survivor, up before the crash
        stack.services.kill(doomed)
        killed_at = time.monotonic()
        await tenant.send("after the crash")
        async with asyncio.timeout(20):
            await stack.model.wait_until(
                lambda log: any(r.script_key == "after the crash" for r in log)
            )
        # Its 700 tokens fit only once the dead call's reservation came back: within one
        # lease TTL (1.5 s, FAST) of the crash, not when the held run's lease lapsed and
        # its next attempt let the old one go.
        assert time.monotonic() - killed_at < 1.5
        await wait_for_status(stack.db_url, held, "completed", timeout=20)
        assert refused(stack) == 0


async def test_429s_that_still_arrive_shrink_the_bucket_to_what_they_said(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path: Path
) -> None:
    # The operator configured nothing ("*:" learns): the provider's 429s and headers teach it.
    async with exec_stack(
        pg_server_url,
        template_db,
        redis_url,
        tmp_path,
        workers=0,
        extra_env=limits_env("*:"),
        model_limits=RateLimits(requests=3, window=3.0),
    ) as stack:
        tenant = await stack.tenant(max_attempts=3)
        run_ids = await asyncio.gather(*(tenant.send(f"learn {i}") for i in range(12)))
        # Every run queued before the worker comes: its first lease fills its 8 slots at once,
        # so the first wave's requests go out together, before any answer could teach it.
        await stack.start_worker()
        await all_completed(stack, list(run_ids), timeout=90)
        first = min(r.timestamp for r in stack.model.requests if r.served == "rate_limited")
        # The first wave (the worker's 8 slots at once) meets the limit; once its 429s are
        # settled the buckets hold what they said, and the rest wait for them. Without the
        # shrink every retry (0.05-0.2 s backoff) would be answered 429 again, and with
        # max_attempts=3 runs would fail.
        assert refused(stack) <= 8
        assert refused(stack, since=first + 3.0) <= 1
