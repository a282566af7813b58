"""Leases flat in a conversation's length: what a Work stream's worker holds of its sessions'
histories (a mirror, `HeldHistories[Mirror]`, one per stream), what a claim then need not read
(`wanted`), and the pushed lease that carries only the rest (`with_history`).

The worker holds, per session, the earlier runs and the summary its last lease on the stream
carried. A later lease of the session reads only the runs completed after the newest it holds
(a session's runs complete in the order they were created: one head at a time), and skips the
summary part when it is the one held; the history is that window: the held runs still after the
latest summary, then the new ones, the last `limit_runs` of them. A session compacted since names
another summary: the held runs it covers drop out and its part is sent. Nothing held (another
worker, a restart, a new stream, evicted): the lease is whole, as a release before sent it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from services.orchestrator.claims import Claimed
from services.orchestrator.repositories.history import EarlierRun as ReadRun
from tether.domain import EarlierRun, Part, Role, Text
from tether.domain.held_histories import HeldHistories
from tether.v1 import orchestrator_pb2

# The most a worker's announced budget is honoured up to: the mirror costs this replica a few
# dozen bytes per held run whatever the worker's memory, so a budget of gigabytes is capped.
MAX_HELD_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class HeldRun:
    """An earlier run the worker holds: when it was created, how many history parts are its
    (its input first) and their serialized size."""

    run_id: str
    created_at: datetime
    parts: int
    size: int


@dataclass(frozen=True, slots=True)
class Mirror:
    """What a stream's worker holds of one session: its earlier runs, oldest first, and its
    summary (`summary_key` "run_id/part_index", "" for none) with the summary part's size."""

    runs: tuple[HeldRun, ...]
    summary_key: str
    summary_size: int

    @property
    def size(self) -> int:
        """The bytes the worker holds for the session."""
        return self.summary_size + sum(r.size for r in self.runs)


StreamHistories = HeldHistories[Mirror]


def stream_histories(hello: orchestrator_pb2.WorkHello) -> StreamHistories | None:
    """The mirror of a new stream, empty; None for a worker that keeps no histories (one of a
    release before, which announces no budget): its leases are whole."""
    if hello.history_cache_bytes <= 0:
        return None
    return HeldHistories(min(hello.history_cache_bytes, MAX_HELD_BYTES))


def known(mirror: Mirror | None) -> tuple[datetime | None, tuple[str, int] | None]:
    """What a claim need not read for a session whose worker holds `mirror`: the runs created
    up to its newest, and its summary part (run id, part index)."""
    if mirror is None:
        return None, None
    after = mirror.runs[-1].created_at if mirror.runs else None
    summary = None
    if mirror.summary_key:
        run_id, _, index = mirror.summary_key.rpartition("/")
        summary = (run_id, int(index))
    return after, summary


def _input_part(run: ReadRun) -> Part:
    return Part(-1, Role.USER, Text(run.input_text), final=True)


def split(
    claimed: Claimed, histories: StreamHistories | None, limit_runs: int
) -> tuple[list[HeldRun], list[ReadRun]]:
    """The lease's history window: the runs the worker holds that stay in it (oldest first),
    and the runs the claim read that are in it."""
    mirror = None if histories is None else histories.use(claimed.run.session_id)
    mark = claimed.summary_mark
    held = [] if mirror is None else list(mirror.runs)
    if mark is not None:
        held = [r for r in held if r.created_at > mark.through_created_at]
    new = list(claimed.earlier)
    extra = len(held) + len(new) - limit_runs
    if extra > 0:
        new = new[max(0, extra - len(held)) :]
        held = held[extra:]
    return held, new


def history_parts(new: list[ReadRun]) -> list[Part]:
    """The new earlier runs' history parts: each one's input, then its transcript."""
    parts: list[Part] = []
    for run in new:
        parts.append(_input_part(run))
        parts.extend(run.parts)
    return parts


def spans(held: list[HeldRun], new: list[ReadRun]) -> tuple[EarlierRun, ...]:
    """Every earlier run in the window, held ones first."""
    return tuple(EarlierRun(r.run_id, r.parts) for r in held) + tuple(
        EarlierRun(r.run_id, len(r.parts) + 1) for r in new
    )


def with_history(
    response: orchestrator_pb2.ClaimRunResponse,
    claimed: Claimed,
    histories: StreamHistories,
    held: list[HeldRun],
    new: list[ReadRun],
) -> orchestrator_pb2.ClaimRunResponse:
    """`response` (whose history holds only the new runs' parts, then the run's own, and whose
    summary is unset when the worker holds it) told how it stands to what the worker holds; the
    mirror updated to what the worker holds after it."""
    session_id = claimed.run.session_id
    before = histories.peek(session_id)
    mark = claimed.summary_mark
    summary_key = "" if mark is None else mark.key
    if claimed.summary is not None:
        summary_size = response.context.summary.ByteSize()
    elif before is not None and mark is not None and before.summary_key == summary_key:
        summary_size = before.summary_size
    else:
        summary_size = 0
    kept = list(held)
    at = 0
    history = response.history
    for run in new:
        count = len(run.parts) + 1
        size = sum(history[i].ByteSize() for i in range(at, at + count))
        kept.append(HeldRun(run.run_id, run.created_at, count, size))
        at += count
    mirror = Mirror(tuple(kept), summary_key, summary_size)
    if kept or summary_key:
        forget = histories.keep(session_id, mirror, mirror.size)
    else:
        forget = [session_id] if histories.forget(session_id) else []
    response.history_cache.CopyFrom(
        orchestrator_pb2.LeaseHistory(
            session_id=session_id,
            held_runs=len(held),
            summary_key=summary_key,
            keep=session_id not in forget and bool(kept or summary_key),
            forget_sessions=forget,
        )
    )
    return response
