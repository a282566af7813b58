"""The run state machine: every status and every allowed transition, in one place.

Each transition is applied by the orchestrator's `repositories/transitions.apply` as one
guarded UPDATE (`WHERE status = ANY(:from) [AND lease_epoch = :epoch] [AND cancel_requested_at
IS NULL]`) with its event appended in the same transaction; a miss means the run had already
moved (or, for a move that yields to a cancel, that a cancel was accepted and the run must end
cancelled) and is reported, never raised into a second side effect.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tether.domain import EventType


class RunStatus(enum.StrEnum):
    """Where a run stands; the spelling is the one clients see."""

    QUEUED = "queued"
    RUNNING = "running"
    RETRY_PENDING = "retry-pending"
    WAITING_FOR_QUESTION = "waiting-for-question"
    WAITING_FOR_APPROVAL = "waiting-for-approval"
    WAITING_FOR_CONNECTION = "waiting-for-connection"
    WAITING_FOR_TIMER = "waiting-for-timer"
    WAITING_FOR_CHILDREN = "waiting-for-children"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        """Whether the run can never move again."""
        return self in TERMINAL

    @property
    def waiting(self) -> bool:
        """Whether the run is parked for a person."""
        return self in WAITING

    @property
    def parked(self) -> bool:
        """Whether the run waits holding no worker for something other than a retry: a person
        (`waiting`), its timer or its child runs."""
        return self in PARKED


TERMINAL = frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED})
WAITING = frozenset(
    {
        RunStatus.WAITING_FOR_QUESTION,
        RunStatus.WAITING_FOR_APPROVAL,
        RunStatus.WAITING_FOR_CONNECTION,
    }
)
# Parked for a person, for time or for its children: no worker held, the session kept.
PARKED = WAITING | {RunStatus.WAITING_FOR_TIMER, RunStatus.WAITING_FOR_CHILDREN}
ACTIVE = frozenset(RunStatus) - TERMINAL


@dataclass(frozen=True)
class Transition:
    """An allowed move: from any of `sources` to `target`, guarded by the lease when `fenced`."""

    name: str
    sources: frozenset[RunStatus]
    target: RunStatus
    fenced: bool
    event_type: EventType
    # Refused while a cancel is requested (`cancel_requested_at` set): an accepted cancel ends
    # the run cancelled, so every other way out of running yields to it in the statement.
    yields_to_cancel: bool = False


def _t(
    name: str,
    sources: set[RunStatus],
    target: RunStatus,
    *,
    fenced: bool,
    event: EventType,
    yields: bool = False,
) -> Transition:
    return Transition(name, frozenset(sources), target, fenced, event, yields)


S = RunStatus
E = EventType
CLAIM = _t("claim", {S.QUEUED}, S.RUNNING, fenced=False, event=E.RUN_STARTED)
COMPLETE = _t("complete", {S.RUNNING}, S.COMPLETED, fenced=True, event=E.RUN_COMPLETED, yields=True)
FAIL = _t("fail", {S.RUNNING}, S.FAILED, fenced=True, event=E.RUN_FAILED, yields=True)
CANCEL_BY_WORKER = _t(
    "cancel_by_worker", {S.RUNNING}, S.CANCELLED, fenced=True, event=E.RUN_CANCELLED
)
SCHEDULE_RETRY = _t(
    "schedule_retry",
    {S.RUNNING},
    S.RETRY_PENDING,
    fenced=True,
    event=E.RUN_RETRY_PENDING,
    yields=True,
)
RETRY_DUE = _t("retry_due", {S.RETRY_PENDING}, S.QUEUED, fenced=False, event=E.RUN_QUEUED)
PARK_QUESTION = _t(
    "park_question",
    {S.RUNNING},
    S.WAITING_FOR_QUESTION,
    fenced=True,
    event=E.QUESTION_REQUESTED,
    yields=True,
)
PARK_APPROVAL = _t(
    "park_approval",
    {S.RUNNING},
    S.WAITING_FOR_APPROVAL,
    fenced=True,
    event=E.APPROVAL_REQUESTED,
    yields=True,
)
PARK_CONNECTION = _t(
    "park_connection",
    {S.RUNNING},
    S.WAITING_FOR_CONNECTION,
    fenced=True,
    event=E.CONNECTION_REQUESTED,
    yields=True,
)
PARK_TIMER = _t(
    "park_timer",
    {S.RUNNING},
    S.WAITING_FOR_TIMER,
    fenced=True,
    event=E.TIMER_SET,
    yields=True,
)
# Its due time came: the one way out of a timer's wait but a cancel (see Timers.fire_due).
TIMER_FIRED = _t("timer_fired", {S.WAITING_FOR_TIMER}, S.QUEUED, fenced=False, event=E.TIMER_FIRED)
PARK_CHILDREN = _t(
    "park_children",
    {S.RUNNING},
    S.WAITING_FOR_CHILDREN,
    fenced=True,
    event=E.CHILDREN_WAITING,
    yields=True,
)
# Every child its delegate calls started has ended: the one way out of the wait but a cancel
# (see Children.resume_done), taken once however many children ended.
CHILDREN_DONE = _t(
    "children_done", {S.WAITING_FOR_CHILDREN}, S.QUEUED, fenced=False, event=E.RUN_QUEUED
)
RESUME = _t("resume", set(WAITING), S.QUEUED, fenced=False, event=E.RUN_QUEUED)
CONSENT_EXPIRED = _t(
    "consent_expired", {S.WAITING_FOR_CONNECTION}, S.FAILED, fenced=False, event=E.RUN_FAILED
)
RELEASE = _t("release", {S.RUNNING}, S.QUEUED, fenced=True, event=E.RUN_QUEUED, yields=True)
REAP_REQUEUE = _t(
    "reap_requeue", {S.RUNNING}, S.QUEUED, fenced=True, event=E.RUN_QUEUED, yields=True
)
REAP_FAIL = _t("reap_fail", {S.RUNNING}, S.FAILED, fenced=True, event=E.RUN_FAILED, yields=True)
CANCEL = _t("cancel", set(ACTIVE - {S.RUNNING}), S.CANCELLED, fenced=False, event=E.RUN_CANCELLED)
# A routing or context failure before any lease was taken (a run must never be left running).
FAIL_UNLEASED = _t("fail_unleased", {S.QUEUED}, S.FAILED, fenced=False, event=E.RUN_FAILED)

TRANSITIONS: dict[str, Transition] = {
    t.name: t
    for t in (
        CLAIM,
        COMPLETE,
        FAIL,
        CANCEL_BY_WORKER,
        SCHEDULE_RETRY,
        RETRY_DUE,
        PARK_QUESTION,
        PARK_APPROVAL,
        PARK_CONNECTION,
        PARK_TIMER,
        TIMER_FIRED,
        PARK_CHILDREN,
        CHILDREN_DONE,
        RESUME,
        CONSENT_EXPIRED,
        RELEASE,
        REAP_REQUEUE,
        REAP_FAIL,
        CANCEL,
        FAIL_UNLEASED,
    )
}


def allowed(source: RunStatus, target: RunStatus) -> bool:
    """Whether any transition moves a run from `source` to `target`."""
    return any(source in t.sources and t.target == target for t in TRANSITIONS.values())
