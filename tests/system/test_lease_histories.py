"""Leases flat in a conversation's length, on the wire, against a real orchestrator process: a
Work stream whose worker keeps histories is sent only the runs it does not hold (and reads only
those: the claim skips what the worker holds), a session compacted since gets its new summary
and loses the runs it covers, and a worker of the previous release (no budget in its hello) is
sent every history whole."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.system.execution_support import ExecStack, Tenant, exec_stack, wait_for_status
from tests.system.test_work_stream import Stream
from tether.testing.model_script import ErrorTurn, newest_text
from tether.v1 import common_pb2, orchestrator_pb2

# a whole stack of processes per module: tens of seconds, so in `make slow` (the 15-minute budget)
pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.slow]

BUDGET = 1 << 20
TURNS = 12  # the conversation's turns before the compared one


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ExecStack]:
    run_dir = Path(tmp_path_factory.mktemp("lease-histories"))
    async with exec_stack(pg_server_url, template_db, redis_url, run_dir, workers=0) as running:
        yield running


async def next_lease(stream: Stream) -> orchestrator_pb2.ClaimRunResponse:
    """Grant one credit; the lease it brings."""
    stream.send(credits=orchestrator_pb2.WorkCredits(credits=1))
    return (await stream.next("lease")).lease


async def answer(stream: Stream, lease: orchestrator_pb2.ClaimRunResponse, text: str) -> None:
    """Write one answer part under the lease and complete the run."""
    run_id, epoch = lease.lease.run_id, lease.lease.epoch
    part = common_pb2.Part(index=0, role="assistant", final=True)
    part.text.text = text
    stream.send(
        checkpoint=orchestrator_pb2.CheckpointRequest(
            run_id=run_id, epoch=epoch, batch=1, parts=[orchestrator_pb2.PartWrite(part=part)]
        )
    )
    assert (await stream.next("ack")).ack.code == 0
    stream.send(
        complete=orchestrator_pb2.CompleteRunRequest(
            run_id=run_id, epoch=epoch, status=common_pb2.RUN_STATUS_COMPLETED, result_text=text
        )
    )
    assert (await stream.next("ack")).ack.code == 0


async def turn(
    stream: Stream, tenant: Tenant, conversation: str, i: int
) -> orchestrator_pb2.ClaimRunResponse:
    run_id = await tenant.send(f"turn {i}", conversation)
    lease = await next_lease(stream)
    assert lease.lease.run_id == run_id
    return lease


def texts(parts: object) -> list[str]:
    return [p.text.text for p in parts]  # type: ignore[attr-defined]


async def test_a_worker_that_keeps_histories_is_sent_only_what_it_lacks(stack: ExecStack) -> None:
    tenant = await stack.tenant()
    conversation = f"c-{uuid.uuid4().hex[:8]}"
    stream = Stream(stack)
    try:
        await stream.hello(history_cache_bytes=BUDGET)
        first = await turn(stream, tenant, conversation, 1)
        assert not first.history and not first.history_cache.keep  # nothing to hold yet
        await answer(stream, first, "answer 1")
        second = await turn(stream, tenant, conversation, 2)
        # Cold: the whole history, to keep.
        assert texts(second.history) == ["turn 1", "answer 1"]
        told = second.history_cache
        assert (told.held_runs, told.keep, told.session_id) == (0, True, second.run.session_id)
        await answer(stream, second, "answer 2")
        third = await turn(stream, tenant, conversation, 3)
        # Warm: the first run is held, only the second is sent; the spans still name both.
        assert texts(third.history) == ["turn 2", "answer 2"]
        assert third.prior_part_count == 2 and third.history_cache.held_runs == 1
        spans = [(s.run_id, s.parts) for s in third.context.earlier_runs]
        assert spans == [(first.lease.run_id, 2), (second.lease.run_id, 2)]

        # Compacted since: a summary through the first run, stored under the third's lease.
        summary = common_pb2.Part(index=1, role="assistant", final=True)
        summary.summary.CopyFrom(
            common_pb2.SummaryPart(
                text="they said turn 1",
                from_run_id=first.lease.run_id,
                through_run_id=first.lease.run_id,
                runs=1,
                parts=2,
            )
        )
        stream.send(
            store_summary=orchestrator_pb2.StoreSummaryRequest(
                run_id=third.lease.run_id, epoch=third.lease.epoch, part=summary
            )
        )
        assert (await stream.next("ack")).ack.code == 0
        await answer(stream, third, "answer 3")
        fourth = await turn(stream, tenant, conversation, 4)
        # The held prefix is not served stale: the new summary is sent, the run it covers is
        # gone from the history, the second run is still held, the third is sent.
        told = fourth.history_cache
        assert told.summary_key == f"{third.lease.run_id}/1"
        assert fourth.context.summary.summary.text == "they said turn 1"
        spans = [s.run_id for s in fourth.context.earlier_runs]
        assert spans == [second.lease.run_id, third.lease.run_id]
        assert told.held_runs == 1
        assert texts(fourth.history)[:2] == ["turn 3", "answer 3"]
        await answer(stream, fourth, "answer 4")
        fifth = await turn(stream, tenant, conversation, 5)
        # The summary is held now: not sent again.
        assert fifth.history_cache.summary_key == f"{third.lease.run_id}/1"
        assert not fifth.context.HasField("summary")
        assert fifth.history_cache.held_runs == 2
        assert texts(fifth.history) == ["turn 4", "answer 4"]
        await answer(stream, fifth, "answer 5")
    finally:
        await stream.close()

    # A worker of the previous release (no budget in its hello), or a new stream: whole.
    old = Stream(stack)
    try:
        await old.hello()
        sixth = await turn(old, tenant, conversation, 6)
        assert not sixth.HasField("history_cache")
        assert sixth.context.summary.summary.text == "they said turn 1"
        # The third run's parts hold the summary too (a part with no text).
        assert texts(sixth.history) == [
            "turn 2", "answer 2", "turn 3", "answer 3", "", "turn 4", "answer 4", "turn 5",
            "answer 5",
        ]  # fmt: skip
        await answer(old, sixth, "answer 6")
    finally:
        await old.close()


async def test_a_session_evicted_from_the_budget_is_forgotten_and_sent_whole(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant()
    one, two = (f"c-{uuid.uuid4().hex[:8]}" for _ in range(2))
    stream = Stream(stack)
    try:
        # Room for one two-run session's history, not two.
        await stream.hello(history_cache_bytes=60)
        for conversation in (one, two):
            await answer(stream, await turn(stream, tenant, conversation, 1), "a")
        a2 = await turn(stream, tenant, one, 2)
        assert a2.history_cache.keep
        await answer(stream, a2, "a")
        b2 = await turn(stream, tenant, two, 2)
        # Keeping the second session evicts the first: the worker is told to forget it.
        assert list(b2.history_cache.forget_sessions) == [a2.run.session_id]
        await answer(stream, b2, "a")
        a3 = await turn(stream, tenant, one, 3)
        assert a3.history_cache.held_runs == 0
        assert texts(a3.history) == ["turn 1", "a", "turn 2", "a"]
        await answer(stream, a3, "a")
    finally:
        await stream.close()


def _newest_user_text(body: dict[str, Any]) -> str:
    users = [m for m in body["messages"] if m["role"] == "user"]
    return newest_text(users[-1]["content"]) if users else ""


# The live clock fact (`2026-12-01 14:03 Tuesday, ...`): two attempts of one turn, seconds apart,
# may fall either side of a minute's turn, so it is compared as a placeholder; all else byte for
# byte.
_CLOCK = re.compile(rb"\d{4}-\d{2}-\d{2} \d{2}:\d{2} [A-Z][a-z]+day")


async def _attempts_of(stack: ExecStack, text: str) -> list[bytes]:
    """The request bodies (canonical JSON) the model server saw for the turn `text`, the live
    clock read as a placeholder."""
    return [
        _CLOCK.sub(b"<clock>", json.dumps(r.body, sort_keys=True).encode())
        for r in stack.model.requests
        if isinstance(r.body, dict) and _newest_user_text(r.body) == text
    ]


async def _retried_elsewhere(
    stack: ExecStack,
    tenant: Tenant,
    conversation: str,
    key: str,
    text: str,
    worker: str,
    **next_env: str,
) -> str:
    """Turn `text`, its first attempt on `worker` (refused by the model: 429, retry after 2 s),
    its second on a new worker started once `worker` is killed; the new worker's name."""
    stack.model.script(key, [ErrorTurn(429, retry_after=2)])
    run_id = await tenant.send(text, conversation)
    await wait_for_status(stack.db_url, run_id, "retry-pending")
    stack.services.kill(worker)
    started = await stack.start_worker(**next_env)
    await wait_for_status(stack.db_url, run_id, "completed", timeout=30)
    return started


@pytest.mark.slow  # three workers started in turn, each retry waits out its 2 s
async def test_a_cold_worker_sends_the_model_the_same_request_a_warm_one_did(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant()
    conversation = f"c-{uuid.uuid4().hex[:8]}"
    key = f"the first turn of {conversation}"  # every turn's script key: the first user text
    warm = await stack.start_worker()
    await tenant.send(key, conversation)
    last = ""
    for i in range(2, TURNS):
        last = await tenant.send(f"turn {i} of {conversation}", conversation)
    await wait_for_status(stack.db_url, last, "completed", timeout=60)

    # Turn TURNS: first asked by the worker that ran every turn before (it holds the history,
    # its lease carried only the last run), then by a restarted worker holding nothing.
    text = f"turn {TURNS} of {conversation}"
    restarted = await _retried_elsewhere(stack, tenant, conversation, key, text, warm)
    warm_body, cold_body = await _attempts_of(stack, text)
    assert cold_body == warm_body
    assert text.encode() in cold_body and f"turn {TURNS - 1} of".encode() in cold_body

    # The next turn: first by the restarted worker (warm again, from its cold lease), then by
    # a worker that keeps no histories (as one of the previous release: whole leases).
    text = f"turn {TURNS + 1} of {conversation}"
    await _retried_elsewhere(
        stack, tenant, conversation, key, text, restarted, TETHER_WORKER_HISTORY_CACHE_BYTES="0"
    )
    warm_body, whole_body = await _attempts_of(stack, text)
    assert whole_body == warm_body
