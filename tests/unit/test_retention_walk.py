"""`tether.retention`: a tenant's policy as its JSON says (a bad value never shortens it), and the
walk each sweep takes: bounded steps, oldest first, continuing after what it examined, back
from the oldest when it had to keep something, due again when the next row expires."""

from __future__ import annotations

import logging
import math
from datetime import UTC, datetime, timedelta

import pytest

from tether.retention import DAY_S, Key, RetentionPolicy, Step, Walk

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def key(i: int) -> Key:
    return (T0 + timedelta(seconds=i), f"row-{i:03d}")


def test_a_policy_takes_what_the_tenant_sets_and_defaults_for_the_rest() -> None:
    assert RetentionPolicy.of("t", {}) == RetentionPolicy()
    assert RetentionPolicy().runs_s == 30 * DAY_S
    policy = RetentionPolicy.of("t", {"retention": {"runs_s": 60, "claims_s": None}})
    assert (policy.runs_s, policy.claims_s) == (60.0, math.inf)
    assert policy.tool_outputs_s == RetentionPolicy().tool_outputs_s


@pytest.mark.parametrize("value", [0, -5, "60", True, [1], {"s": 1}])
def test_a_value_that_is_not_a_positive_number_keeps_the_default(
    value: object, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        policy = RetentionPolicy.of("t", {"retention": {"runs_s": value}})
    assert policy.runs_s == RetentionPolicy().runs_s
    assert "runs_s" in caplog.text


def test_an_unknown_setting_or_a_retention_that_is_no_object_changes_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        assert RetentionPolicy.of("t", {"retention": {"run_s": 1}}) == RetentionPolicy()
        assert RetentionPolicy.of("t", {"retention": [1]}) == RetentionPolicy()
    assert "run_s" in caplog.text and "not an object" in caplog.text


class Rows:
    """A tenant's rows as a step sees them: `expired` keys in order, of which those in `needed`
    are kept; `next_in` is what the step says when it reaches the end."""

    def __init__(
        self, expired: int, needed: frozenset[int] = frozenset(), next_in: float | None = 5.0
    ) -> None:
        self.rows = [key(i) for i in range(expired)]
        self.needed = {key(i) for i in needed}
        self.next_in = next_in
        self.calls: list[Key | None] = []

    async def step(
        self, tenant: str, policy: RetentionPolicy, after: Key | None, batch: int
    ) -> Step:
        self.calls.append(after)
        after_key = after or (datetime.min.replace(tzinfo=UTC), "")
        examined = [k for k in self.rows if k > after_key][:batch]
        removed = [k for k in examined if k not in self.needed]
        self.rows = [k for k in self.rows if k not in removed]
        last = examined[-1] if examined else None
        next_in = self.next_in if len(examined) < batch else None
        return Step(len(examined), len(removed), len(examined) - len(removed), last, next_in)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


POLICIES = {"t": RetentionPolicy()}


async def test_a_full_batch_is_due_again_at_once_and_the_walk_continues_after_it() -> None:
    rows, clock = Rows(expired=5), Clock()
    walk = Walk("w", rows.step, batch=2, repass_s=60, look_again_s=30, clock=clock)
    assert await walk.round(POLICIES) == 0
    assert await walk.round(POLICIES) == 0
    assert await walk.round(POLICIES) == 5.0  # the end: due when the next row expires
    assert rows.calls == [None, key(1), key(3)]
    assert rows.rows == [] and walk.removed == 5


async def test_not_due_is_not_looked_at_and_a_step_that_cannot_tell_looks_again_later() -> None:
    rows, clock = Rows(expired=1, next_in=None), Clock()
    walk = Walk("w", rows.step, batch=10, repass_s=60, look_again_s=30, clock=clock)
    assert await walk.round(POLICIES) == 30
    clock.now += 29
    assert await walk.round(POLICIES) == pytest.approx(1)
    assert len(rows.calls) == 1
    clock.now += 1
    await walk.round(POLICIES)
    assert len(rows.calls) == 2


async def test_rows_kept_are_looked_at_again_from_the_oldest_after_the_repass() -> None:
    rows, clock = Rows(expired=4, needed={0}, next_in=600), Clock()
    walk = Walk("w", rows.step, batch=10, repass_s=60, look_again_s=30, clock=clock)
    assert await walk.round(POLICIES) == 60  # sooner than the next expiry: the repass
    assert rows.rows == [key(0)]
    rows.needed.clear()  # no longer needed (its conversation moved on)
    clock.now += 60
    await walk.round(POLICIES)
    assert rows.calls == [None, None]  # from the oldest again
    assert rows.rows == []


async def test_a_changed_policy_or_a_new_tenant_is_walked_at_once_and_a_gone_one_forgotten() -> (
    None
):
    rows, clock = Rows(expired=1, next_in=600), Clock()
    walk = Walk("w", rows.step, batch=10, repass_s=60, look_again_s=30, clock=clock)
    await walk.round(POLICIES)
    shorter = {"t": RetentionPolicy(runs_s=1)}
    assert await walk.round(shorter) == 600
    assert rows.calls == [None, None]
    assert await walk.round({}) is None


async def test_a_round_takes_at_most_its_steps_and_leaves_the_rest_due() -> None:
    calls: list[str] = []

    async def step(tenant: str, policy: RetentionPolicy, after: Key | None, batch: int) -> Step:
        calls.append(tenant)
        return Step(0, 0, 0, None, next_in=50)

    walk = Walk("w", step, batch=10, repass_s=60, look_again_s=30, steps=3, clock=Clock())
    many = {f"t{i}": RetentionPolicy() for i in range(7)}
    assert await walk.round(many) == 0
    assert len(calls) == 3
    await walk.round(many)
    assert await walk.round(many) == 50
    assert sorted(calls) == sorted(many)
