"""The state machine's table is coherent."""

from __future__ import annotations

from tether import states
from tether.states import TERMINAL, TRANSITIONS, WAITING, RunStatus


def test_terminal_statuses_have_no_way_out() -> None:
    for transition in TRANSITIONS.values():
        assert not (transition.sources & TERMINAL), transition.name


def test_every_status_is_reachable_from_queued() -> None:
    seen = {RunStatus.QUEUED}
    frontier = [RunStatus.QUEUED]
    while frontier:
        current = frontier.pop()
        for t in TRANSITIONS.values():
            if current in t.sources and t.target not in seen:
                seen.add(t.target)
                frontier.append(t.target)
    assert seen == set(RunStatus)


def test_worker_writes_are_fenced_and_person_driven_moves_are_not() -> None:
    for t in TRANSITIONS.values():
        if RunStatus.RUNNING in t.sources and t.name != "claim":
            assert t.fenced or t.name == "cancel", t.name
    assert not states.RESUME.fenced
    assert states.RESUME.sources == WAITING


def test_every_non_terminal_status_can_be_cancelled() -> None:
    for status in set(RunStatus) - TERMINAL:
        assert states.allowed(status, RunStatus.CANCELLED), status


def test_cancel_by_caller_does_not_take_a_running_run_away_from_its_worker() -> None:
    # A running run is cancelled by the worker holding the lease (fenced), so the provider
    # stream and tool tasks are stopped by whoever owns them.
    assert RunStatus.RUNNING not in states.CANCEL.sources
    assert states.CANCEL_BY_WORKER.fenced


def test_a_timer_wait_is_left_only_by_its_firing_or_a_cancel() -> None:
    ways_out = {t.name for t in TRANSITIONS.values() if RunStatus.WAITING_FOR_TIMER in t.sources}
    assert ways_out == {"timer_fired", "cancel"}
    assert states.TIMER_FIRED.target == RunStatus.QUEUED and not states.TIMER_FIRED.fenced
    # Parked by the worker under its lease, and a cancel accepted first wins.
    assert states.PARK_TIMER.fenced and states.PARK_TIMER.yields_to_cancel
    # Not a person's pause: no interaction resumes it.
    assert not RunStatus.WAITING_FOR_TIMER.waiting and RunStatus.WAITING_FOR_TIMER.parked


def test_a_wait_for_children_is_left_only_when_they_have_ended_or_by_a_cancel() -> None:
    waiting = RunStatus.WAITING_FOR_CHILDREN
    ways_out = {t.name for t in TRANSITIONS.values() if waiting in t.sources}
    assert ways_out == {"children_done", "cancel"}
    assert states.CHILDREN_DONE.target == RunStatus.QUEUED and not states.CHILDREN_DONE.fenced
    assert states.PARK_CHILDREN.fenced and states.PARK_CHILDREN.yields_to_cancel
    assert not waiting.waiting and waiting.parked
