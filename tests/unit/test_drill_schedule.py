"""The soak's fault schedule is a function of its seed: the same seed, the same faults in the
same order at the same offsets; the counts the issue asks for per minute."""

from __future__ import annotations

from collections import Counter

from tests.drill.chaos import OTHER_FAULTS, WORKER_KILLS_PER_MINUTE, schedule


def test_a_seed_names_one_schedule() -> None:
    assert schedule(7, 300) == schedule(7, 300)
    assert schedule(7, 300) != schedule(8, 300)


def test_each_minute_has_several_worker_kills_and_one_of_every_other_fault() -> None:
    for minutes in (1, 5):
        plan = schedule(1, minutes * 60)
        kinds = Counter(kind for _, kind in plan)
        assert kinds["kill_worker"] == WORKER_KILLS_PER_MINUTE * minutes
        assert {k: kinds[k] for k in OTHER_FAULTS} == dict.fromkeys(OTHER_FAULTS, minutes)
        offsets = [offset for offset, _ in plan]
        assert offsets == sorted(offsets)
        assert offsets[0] > 0 and offsets[-1] < minutes * 60, "inside the load"
