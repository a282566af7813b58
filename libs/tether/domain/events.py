"""Every event of a run: its type, and the one constructor that builds each event's payload."""

from __future__ import annotations

import enum
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from tether.domain.outcomes import Completed, ModelTurn, RunError
from tether.domain.parts import Part, Summary, camel, part_json


class EventType(enum.StrEnum):
    """Every event of a run, by its stable transport name (the event union in events.proto)."""

    RUN_QUEUED = "run.queued"
    RUN_STARTED = "run.started"
    RUN_CHECKPOINTED = "run.checkpointed"
    RUN_COMPLETED = "run.completed"
    RUN_FAILED = "run.failed"
    RUN_CANCELLED = "run.cancelled"
    RUN_RETRY_PENDING = "run.retry-pending"
    PART_ADDED = "part.added"
    PART_UPDATED = "part.updated"
    PART_SUPERSEDED = "part.superseded"
    TOOL_STARTED = "tool.started"
    TOOL_COMPLETED = "tool.completed"
    TOOL_FAILED = "tool.failed"
    QUESTION_REQUESTED = "question.requested"
    QUESTION_ANSWERED = "question.answered"
    APPROVAL_REQUESTED = "approval.requested"
    APPROVAL_DECIDED = "approval.decided"
    CONNECTION_REQUESTED = "connection.requested"
    CONNECTION_COMPLETED = "connection.completed"
    TIMER_SET = "timer.set"
    TIMER_FIRED = "timer.fired"
    CHILDREN_WAITING = "children.waiting"
    CHILD_STARTED = "child.started"
    CHILD_COMPLETED = "child.completed"
    USAGE_UPDATED = "usage.updated"
    CONTEXT_COMPACTED = "context.compacted"
    DELIVERY_SENT = "delivery.sent"
    DELIVERY_FAILED = "delivery.failed"
    DELIVERY_UNKNOWN = "delivery.unknown"
    DELIVERY_DENIED = "delivery.denied"
    TEXT_DELTA = "text.delta"
    KEEPALIVE = "keepalive"

    @property
    def field(self) -> str:
        """Its member of the RunEvent union (`run.retry-pending` -> run_retry_pending)."""
        return self.value.replace(".", "_").replace("-", "_")

    @property
    def ephemeral(self) -> bool:
        """Never persisted and carried with seq 0: live token deltas and stream keepalives."""
        return self in _EPHEMERAL

    @property
    def terminal(self) -> bool:
        """The last event of a run: a stream ends after delivering it."""
        return self in TERMINAL_EVENTS


_EPHEMERAL = frozenset({EventType.TEXT_DELTA, EventType.KEEPALIVE})
TERMINAL_EVENTS = frozenset(
    {EventType.RUN_COMPLETED, EventType.RUN_FAILED, EventType.RUN_CANCELLED}
)


@dataclass(frozen=True, slots=True)
class Event:
    """A durable event to append: its type and payload, the stored JSON of its union member
    (protobuf's JSON mapping, camelCase). Build one with the constructors below."""

    type: EventType
    payload: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class StoredEvent:
    """An event appended to a run's log, with the seq it was given."""

    seq: int
    event: Event


# -- event constructors: each event's payload is built here and nowhere else ---------------------


def run_queued(attempt: int, reason: str) -> Event:
    """The run waits for a worker (admitted, resumed, released, requeued or due for a retry)."""
    payload: dict[str, Any] = {"reason": reason}
    if attempt:
        payload["attempt"] = attempt
    return Event(EventType.RUN_QUEUED, payload)


def run_started(attempt: int, worker_id: str, lease_epoch: int) -> Event:
    """A worker leased the run."""
    return Event(
        EventType.RUN_STARTED,
        {"attempt": attempt, "workerId": worker_id, "leaseEpoch": lease_epoch},
    )


def run_completed(done: Completed, usage: Mapping[str, int]) -> Event:
    """The runtime answered (see `Completed`)."""
    return Event(
        EventType.RUN_COMPLETED,
        {
            "resultText": done.result_text,
            "taskOutcome": done.task_outcome,
            "warnings": list(done.warnings),
            "usage": _usage_json(usage),
        },
    )


def stored_by_reference(
    event: Event, written: Container[int], *, turn: ModelTurn | None = None
) -> Event:
    """`event` as it is stored by reference (`tether.formats.BY_REFERENCE`), without what its
    run's rows keep whole: run.completed without the answer and the usage (`runs.result_text`,
    `runs.usage`); part.added and part.updated of a final part, not superseded, written as it is
    in the same statement (its index in `written`), as the part's index (its `run_parts` row,
    which no later write changes but to mark it superseded); usage.updated without its turn,
    given the `turn` the same statement writes as a `usage_turns` row naming the event's seq
    (`tether.formats.USAGE_BY_REFERENCE`), when the event carries exactly that turn. Any other
    event as it is. A reader fills them in (`filled_by_reference`)."""
    payload = event.payload
    if event.type == EventType.USAGE_UPDATED:
        if turn is None or _carried_turn(payload.get("turn")) != turn:
            return event
        return Event(event.type, {k: v for k, v in payload.items() if k != "turn"})
    if event.type == EventType.RUN_COMPLETED:
        return Event(event.type, {k: v for k, v in payload.items() if k not in _RUN_KEEPS})
    if event.type in _PART_EVENTS:
        part = payload.get("part") or {}
        index = int(part.get("index", 0))
        if part.get("final") and not part.get("superseded") and index in written:
            return Event(event.type, {"partIndex": index})
    return event


def filled_by_reference(
    type_: str,
    stored: Mapping[str, Any],
    *,
    result_text: str | None,
    usage: Mapping[str, int],
    parts: Mapping[int, Part],
    turn: ModelTurn | None = None,
) -> dict[str, Any]:
    """The payload `stored_by_reference` stored, whole again from its run's rows: its answer and
    usage, its parts by index (as they stood when the event was written: final, not yet
    superseded), and a usage.updated's `turn` (its `usage_turns` row)."""
    if type_ == EventType.USAGE_UPDATED:
        if turn is None:
            raise KeyError("usage.updated stored by reference was filled without its turn")
        return {"turn": turn_json(turn), **stored}
    if type_ == EventType.RUN_COMPLETED:
        return {
            "resultText": result_text or "",
            "taskOutcome": stored.get("taskOutcome", ""),
            "warnings": list(stored.get("warnings", [])),
            "usage": _usage_json(usage),
        }
    index = int(stored.get("partIndex", 0))
    return {"part": part_json(replace(parts[index], superseded=False))}


# What a stored-by-reference event leaves to its run's rows.
_RUN_KEEPS = frozenset({"resultText", "usage"})
_PART_EVENTS = frozenset({EventType.PART_ADDED, EventType.PART_UPDATED})


def run_failed(error: RunError) -> Event:
    """The run failed for good."""
    return Event(EventType.RUN_FAILED, {"error": error.to_json()})


def run_cancelled(reason: str) -> Event:
    """The run ended cancelled."""
    return Event(EventType.RUN_CANCELLED, {"reason": reason})


def run_retry_pending(attempt: int, max_attempts: int, next_at_iso: str, error: RunError) -> Event:
    """A transient failure: the next attempt starts at `next_at_iso` (RFC 3339, UTC)."""
    return Event(
        EventType.RUN_RETRY_PENDING,
        {
            "attempt": attempt,
            "maxAttempts": max_attempts,
            "nextAttemptAt": next_at_iso,
            "error": error.to_json(),
        },
    )


def part_added(part: Part) -> Event:
    """A new part, whole as it stands."""
    return Event(EventType.PART_ADDED, {"part": part_json(part)})


def part_updated(part: Part) -> Event:
    """A part rewritten (finished, as a rule), whole as it stands."""
    return Event(EventType.PART_UPDATED, {"part": part_json(part)})


def part_superseded(index: int, attempt: int) -> Event:
    """A later attempt took the part's place: a client drops what it rendered of it."""
    return Event(EventType.PART_SUPERSEDED, {"partIndex": index, "attempt": attempt})


def tool_started(tool_call_id: str, name: str) -> Event:
    """A call started running."""
    return Event(EventType.TOOL_STARTED, {"toolCallId": tool_call_id, "name": name})


def tool_completed(tool_call_id: str, name: str, *, replayed: bool = False) -> Event:
    """A call finished; `replayed` when its stored result stood in for firing it again."""
    payload: dict[str, Any] = {"toolCallId": tool_call_id, "name": name}
    if replayed:
        payload["replayed"] = True
    return Event(EventType.TOOL_COMPLETED, payload)


def tool_failed(tool_call_id: str, name: str, error: RunError) -> Event:
    """A call failed, was refused or was interrupted."""
    return Event(
        EventType.TOOL_FAILED,
        {"toolCallId": tool_call_id, "name": name, "error": error.to_json()},
    )


def interaction_event(type_: EventType, interaction_id: str, **detail: str) -> Event:
    """A question, approval or connection was requested or resolved (`detail`: the decision
    or outcome)."""
    return Event(type_, {"interactionId": interaction_id, **detail})


def timer_set(tool_call_id: str, due_at_iso: str) -> Event:
    """The run parked on its `wait_until` call `tool_call_id` until `due_at_iso` (RFC 3339,
    UTC)."""
    return Event(EventType.TIMER_SET, {"toolCallId": tool_call_id, "dueAt": due_at_iso})


def timer_fired(due_at_iso: str) -> Event:
    """The run's timer, due at `due_at_iso`, woke it (the event's time is when it fired)."""
    return Event(EventType.TIMER_FIRED, {"dueAt": due_at_iso})


def child_started(tool_call_id: str, child_run_id: str, agent: str) -> Event:
    """The run's `delegate` call `tool_call_id` started child run `child_run_id` of `agent`."""
    return Event(
        EventType.CHILD_STARTED,
        {"toolCallId": tool_call_id, "childRunId": child_run_id, "agent": agent},
    )


def children_waiting(tool_call_ids: Sequence[str]) -> Event:
    """The run parked until the children its `delegate` calls `tool_call_ids` started have all
    ended, holding no worker."""
    return Event(EventType.CHILDREN_WAITING, {"toolCallIds": list(tool_call_ids)})


def child_completed(tool_call_id: str, child_run_id: str, status: str) -> Event:
    """Child run `child_run_id` (of the `delegate` call `tool_call_id`) ended `status`
    (completed, failed or cancelled)."""
    return Event(
        EventType.CHILD_COMPLETED,
        {"toolCallId": tool_call_id, "childRunId": child_run_id, "status": status},
    )


def usage_updated(turn: ModelTurn, total: Mapping[str, int]) -> Event:
    """One model turn's usage, and the attempt's total so far."""
    return Event(
        EventType.USAGE_UPDATED,
        {"turn": turn_json(turn), "total": _usage_json(total)},
    )


def _carried_turn(carried: Any) -> ModelTurn | None:
    """The turn a usage.updated carries (its counts as numbers or, through the wire's JSON, as
    the strings of int64s); None when it is not one."""
    if not isinstance(carried, Mapping) or set(carried) - _TURN_KEYS:
        return None
    try:
        counts = {k: int(carried.get(camel(k), 0)) for k in _TURN_COUNTS}
        return ModelTurn(str(carried.get("model", "")), **counts)
    except (TypeError, ValueError):
        return None


_TURN_COUNTS = tuple(f.name for f in fields(ModelTurn) if f.name != "model")
_TURN_KEYS = frozenset({"model", *map(camel, _TURN_COUNTS)})


def turn_json(turn: ModelTurn) -> dict[str, Any]:
    """A priced model turn as usage.updated carries it."""
    return {"model": turn.model, **_usage_json({**turn.tokens(), "cost_micros": turn.cost_micros})}


def context_compacted(part_index: int, summary: Summary) -> Event:
    """Older history was summarised to fit the agent's context budget: the summary is the part
    at `part_index`, standing in for the runs from `summary.from_run_id` through
    `summary.through_run_id` (their parts are kept), with the request's estimated tokens before
    and after."""
    return Event(
        EventType.CONTEXT_COMPACTED,
        {
            "partsCompacted": summary.parts,
            "fromRunId": summary.from_run_id,
            "throughRunId": summary.through_run_id,
            "runsCompacted": summary.runs,
            "tokensBefore": summary.tokens_before,
            "tokensAfter": summary.tokens_after,
            "summaryPartIndex": part_index,
        },
    )


def text_delta(part_index: int, text: str, offset: int) -> Event:
    """Live tokens of a streaming text part (ephemeral: never stored)."""
    return Event(EventType.TEXT_DELTA, {"partIndex": part_index, "text": text, "offset": offset})


def _usage_json(usage: Mapping[str, int]) -> dict[str, int]:
    return {camel(k): v for k, v in usage.items() if v}
