"""The histories this worker holds between leases on one Work stream, so that a lease of a long
conversation carries only what is new (`ClaimRunResponse.history_cache`; the orchestrator's
side is `services.orchestrator.lease_histories`).

Per session: the earlier runs (each one's history parts, its input first) and the summary the
last lease on the stream carried, within the byte budget the hello announced (the serialized
size of the parts, as the orchestrator measures it). The orchestrator keeps a mirror of it and
evicts: a lease names the sessions to forget. A lease says how many of its leading earlier runs
and whether its summary come from here; each is checked (run id, part count, summary key)
before it is used, and one not held as named is `HistoryOutOfStep`: never served stale.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tether.convert.work import assignment_from_proto
from tether.domain import Assignment, Part
from tether.domain.held_histories import HeldHistories
from tether.v1 import orchestrator_pb2


class HistoryOutOfStep(Exception):
    """A lease counts on history this worker does not hold as it names it."""


@dataclass(frozen=True, slots=True)
class HeldRun:
    """One earlier run as held: its history parts and their serialized size."""

    parts: tuple[Part, ...]
    size: int


@dataclass(frozen=True, slots=True)
class HeldSession:
    """What is held of one session: its earlier runs by id, and its summary by key."""

    runs: dict[str, HeldRun]
    summary_key: str
    summary: Part | None
    summary_size: int

    @property
    def size(self) -> int:
        """The bytes held for the session."""
        return self.summary_size + sum(r.size for r in self.runs.values())


class HistoryCache:
    """Sessions' histories this worker holds, LRU by bytes within `budget_bytes`."""

    def __init__(self, budget_bytes: int) -> None:
        self._held: HeldHistories[HeldSession] = HeldHistories(budget_bytes)

    @property
    def budget_bytes(self) -> int:
        """The most it holds (what the hello announces)."""
        return self._held.budget_bytes

    @property
    def size(self) -> int:
        """The bytes it holds now."""
        return self._held.size

    def holds(self, session_id: str) -> bool:
        """Whether something of the session is held."""
        return session_id in self._held

    def clear(self) -> None:
        """Hold nothing: a new stream's orchestrator counts on nothing held."""
        self._held.clear()

    def forget(self, session_id: str) -> None:
        """Hold nothing of the session."""
        self._held.forget(session_id)

    def assignment(self, lease: orchestrator_pb2.ClaimRunResponse) -> Assignment:
        """The run a pushed lease hands the worker, its history whole: the parts the lease
        leaves out taken from what is held; and what the lease says to forget and keep, done.
        A lease with no `history_cache` (an orchestrator of a release before) is whole."""
        assignment = assignment_from_proto(lease)
        if not lease.HasField("history_cache"):
            return assignment
        told = lease.history_cache
        for session_id in told.forget_sessions:
            self._held.forget(session_id)
        spans = assignment.earlier_runs
        if told.held_runs > len(spans):
            raise HistoryOutOfStep(f"{told.held_runs} runs held of a history of {len(spans)}")
        summary_held = bool(told.summary_key) and not lease.context.HasField("summary")
        prior: list[Part] = []
        held_runs: list[HeldRun] = []
        summary, summary_size = assignment.summary_part, lease.context.summary.ByteSize()
        if told.held_runs or summary_held:
            held = self._held.use(told.session_id)
            if held is None:
                raise HistoryOutOfStep(f"nothing held of session {told.session_id}")
            for span in spans[: told.held_runs]:
                run = held.runs.get(span.run_id)
                if run is None or len(run.parts) != span.parts:
                    raise HistoryOutOfStep(f"run {span.run_id} not held as the lease names it")
                prior.extend(run.parts)
                held_runs.append(run)
            if summary_held:
                if held.summary_key != told.summary_key or held.summary is None:
                    raise HistoryOutOfStep(f"summary {told.summary_key} not held")
                summary, summary_size = held.summary, held.summary_size
        whole = replace(
            assignment,
            history=(*prior, *assignment.history),
            prior_part_count=len(prior) + assignment.prior_part_count,
            summary_part=summary,
        )
        if sum(span.parts for span in spans) != whole.prior_part_count:
            raise HistoryOutOfStep("the earlier runs' spans do not cover the history's parts")
        if told.keep:
            self._keep(told, lease, whole, held_runs, summary_size)
        return whole

    def _keep(
        self,
        told: orchestrator_pb2.LeaseHistory,
        lease: orchestrator_pb2.ClaimRunResponse,
        whole: Assignment,
        held_runs: list[HeldRun],
        summary_size: int,
    ) -> None:
        runs: dict[str, HeldRun] = {}
        held_parts = sum(len(r.parts) for r in held_runs)
        at = 0
        for i, span in enumerate(whole.earlier_runs):
            parts = whole.history[at : at + span.parts]
            if i < len(held_runs):
                runs[span.run_id] = held_runs[i]
            else:
                sent = at - held_parts  # where the run's parts sit in the lease's own history
                size = sum(lease.history[j].ByteSize() for j in range(sent, sent + span.parts))
                runs[span.run_id] = HeldRun(parts, size)
            at += span.parts
        summary = whole.summary_part if told.summary_key else None
        session = HeldSession(runs, told.summary_key, summary, summary_size if summary else 0)
        self._held.keep(told.session_id, session, session.size)
