"""The histories a worker keeps between leases: a lease leaving out what is held is made whole
exactly as the whole lease would be, what is named is checked before it is used (a run not held,
held with another part count, a summary of another key: refused, never served stale), what the
orchestrator says to forget is forgotten, and the bytes held stay within the budget, least
recently used evicted first."""

from __future__ import annotations

import pytest

from services.worker.history_cache import HistoryCache, HistoryOutOfStep
from tether.convert.work import assignment_from_proto
from tether.domain.held_histories import HeldHistories
from tether.v1 import common_pb2, orchestrator_pb2

SESSION = "ses_1"


def text(index: int, role: str, words: str) -> common_pb2.Part:
    part = common_pb2.Part(index=index, role=role, final=True)
    part.text.text = words
    return part


def run_parts(run_id: str) -> list[common_pb2.Part]:
    """An earlier run's history parts: its input, then its answer."""
    return [text(-1, "user", f"asked in {run_id}"), text(0, "assistant", f"answered in {run_id}")]


def summary_part(through: str) -> common_pb2.Part:
    part = common_pb2.Part(index=1, role="assistant", final=True)
    part.summary.text = f"all through {through}"
    part.summary.through_run_id = through
    return part


def lease(
    runs: list[str],
    *,
    held_runs: int | None = None,
    summary: tuple[str, common_pb2.Part | None] = ("", None),
    keep: bool = True,
    forget: tuple[str, ...] = (),
    session: str = SESSION,
) -> orchestrator_pb2.ClaimRunResponse:
    """A pushed lease of a run whose history is the earlier `runs`: whole when `held_runs` is
    None, else leaving out the first `held_runs` of them (and the summary part when None)."""
    skip = held_runs or 0
    history = [p for r in runs[skip:] for p in run_parts(r)]
    own = [text(0, "assistant", "own so far")]
    response = orchestrator_pb2.ClaimRunResponse(
        claimed=True,
        lease=orchestrator_pb2.Lease(run_id="run_now", epoch=3, attempt=1),
        run=common_pb2.Run(run_id="run_now", tenant_id="t", input_text="now?"),
        history=history + own,
        prior_part_count=len(history),
        context=orchestrator_pb2.AttemptContext(
            earlier_runs=[orchestrator_pb2.EarlierRunSpan(run_id=r, parts=2) for r in runs]
        ),
    )
    key, part = summary
    if part is not None:
        response.context.summary.CopyFrom(part)
    if held_runs is not None:
        response.history_cache.CopyFrom(
            orchestrator_pb2.LeaseHistory(
                session_id=session,
                held_runs=held_runs,
                summary_key=key,
                keep=keep,
                forget_sessions=list(forget),
            )
        )
    return response


def whole(runs: list[str], summary: common_pb2.Part | None = None) -> object:
    """The assignment a whole lease hands the worker."""
    response = lease(runs, summary=("", summary))
    return assignment_from_proto(response)


def test_a_lease_of_a_release_before_is_whole_and_nothing_is_kept() -> None:
    cache = HistoryCache(1 << 20)
    assert cache.assignment(lease(["r1", "r2"])) == whole(["r1", "r2"])
    assert cache.size == 0 and not cache.holds(SESSION)


def test_a_lease_leaving_out_the_held_runs_is_made_whole_as_the_whole_lease() -> None:
    cache = HistoryCache(1 << 20)
    assert cache.assignment(lease(["r1", "r2"], held_runs=0)) == whole(["r1", "r2"])
    assert cache.holds(SESSION) and cache.size > 0
    # The window slid: r1 dropped out, r3 is new; r2 comes from what is held.
    assert cache.assignment(lease(["r2", "r3"], held_runs=1)) == whole(["r2", "r3"])
    assert cache.assignment(lease(["r2", "r3", "r4"], held_runs=2)) == whole(["r2", "r3", "r4"])


def test_the_held_summary_stands_in_until_a_compaction_names_another() -> None:
    cache = HistoryCache(1 << 20)
    first = summary_part("r1")
    got = cache.assignment(lease(["r2"], held_runs=0, summary=("r2/1", first)))
    assert got == whole(["r2"], first)
    # Held: the lease leaves the summary out, the worker's copy stands in.
    assert cache.assignment(lease(["r2", "r3"], held_runs=1, summary=("r2/1", None))) == whole(
        ["r2", "r3"], first
    )
    # Compacted since: another key, its part sent; the held one is not used.
    second = summary_part("r3")
    got = cache.assignment(lease(["r4"], held_runs=0, summary=("r4/1", second)))
    assert got == whole(["r4"], second)
    with pytest.raises(HistoryOutOfStep, match="summary r2/1"):
        cache.assignment(lease(["r4"], held_runs=1, summary=("r2/1", None)))


@pytest.mark.parametrize(
    "named",
    [
        lease(["r9", "r3"], held_runs=1),  # a run not held
        lease(["r1", "r2", "r3"], held_runs=3),  # more runs than held
        lease(["r1"], held_runs=1, session="ses_other"),  # a session not held
        lease(["r1", "r2"], held_runs=1, summary=("r0/1", None)),  # a summary not held
    ],
)
def test_what_a_lease_names_is_checked_before_it_is_used(
    named: orchestrator_pb2.ClaimRunResponse,
) -> None:
    cache = HistoryCache(1 << 20)
    cache.assignment(lease(["r1", "r2"], held_runs=0))
    with pytest.raises(HistoryOutOfStep):
        cache.assignment(named)


def test_a_run_held_with_another_part_count_is_refused() -> None:
    cache = HistoryCache(1 << 20)
    cache.assignment(lease(["r1", "r2"], held_runs=0))
    longer = lease(["r1", "r3"], held_runs=1)
    longer.context.earlier_runs[0].parts = 3
    with pytest.raises(HistoryOutOfStep, match="r1"):
        cache.assignment(longer)


def test_what_the_orchestrator_says_to_forget_is_forgotten() -> None:
    cache = HistoryCache(1 << 20)
    cache.assignment(lease(["r1"], held_runs=0, session="ses_a"))
    cache.assignment(lease(["r1"], held_runs=0, session="ses_b", forget=("ses_a",)))
    assert not cache.holds("ses_a") and cache.holds("ses_b")
    # Told not to keep: nothing of the session is kept.
    cache.assignment(lease(["r1"], held_runs=0, session="ses_c", keep=False))
    assert not cache.holds("ses_c")


def test_the_bytes_held_stay_within_the_budget_least_recently_used_evicted_first() -> None:
    one_run = sum(p.ByteSize() for p in run_parts("r1"))
    cache = HistoryCache(2 * one_run)
    for session in ("ses_a", "ses_b"):
        cache.assignment(lease(["r1"], held_runs=0, session=session))
    assert cache.size == 2 * one_run
    cache.assignment(lease(["r1", "r2"], held_runs=1, session="ses_a"))  # a, used: over budget
    assert cache.size <= cache.budget_bytes
    assert cache.holds("ses_a") and not cache.holds("ses_b")  # b was the least recent
    # A session over the whole budget alone is not kept, and evicts nothing.
    cache.assignment(lease(["r1", "r2", "r3"], held_runs=0, session="ses_c"))
    assert not cache.holds("ses_c") and cache.holds("ses_a")


def test_the_ledger_evicts_by_bytes_in_least_recent_order() -> None:
    ledger: HeldHistories[str] = HeldHistories(100)
    assert ledger.keep("a", "A", 40) == []
    assert ledger.keep("b", "B", 40) == []
    assert ledger.use("a") == "A"  # a is now the most recent
    assert ledger.keep("c", "C", 40) == ["b"]
    assert ledger.keep("a", "A2", 60) == []  # replacing a frees its own bytes first
    assert ledger.keep("a", "A3", 61) == ["c"]
    assert (ledger.size, ledger.peek("a")) == (61, "A3")
    assert ledger.keep("d", "D", 101) == ["d"] and "d" not in ledger
    assert ledger.forget("a") and not ledger.forget("a") and ledger.size == 0
