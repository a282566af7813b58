"""Every interaction is bound to the pause it belongs to, with the services as real processes.

An orphan is an interaction a worker stored before it died, without parking the run on it: it
can neither wake, fail nor be claimed by a later pause of the same run. One test SIGKILLs a real
worker between storing its approval and parking on it (the run row held by the test, so the
worker's last checkpoint before the park waits while it dies); the others play the dead worker
themselves, with the worker's credential, to place orphans of every kind: it takes the lease,
stores the interaction and never parks (the lease then expires and the reaper requeues the run).
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from sqlalchemy import select, update

from tests.system.execution_support import (
    TOOLS,
    ExecStack,
    Tenant,
    exec_stack,
    parts_of,
    run_row,
    wait_for_status,
)
from tests.system.row_hold import CHECKPOINT, RowHold
from tether.client import TetherClient
from tether.db.engine import create_engine
from tether.db.schema import interactions, tenants
from tether.runtime.rpc import internal_channel
from tether.testing.eventually import eventually
from tether.testing.model_server import TextTurn, ToolUseTurn
from tether.v1 import (
    common_pb2,
    interactions_pb2,
    interactions_pb2_grpc,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
)

# processes killed and restarted, services outlived: seconds each, so in `make slow` (the budget)
pytestmark = pytest.mark.slow


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ExecStack]:
    run_dir = Path(tmp_path_factory.mktemp("binding"))
    # Pending interactions are checked for their binding from 2 s on (an orphan question has
    # no TTL: only that check sweeps it).
    async with exec_stack(
        pg_server_url,
        template_db,
        redis_url,
        run_dir,
        workers=1,
        extra_env={"TETHER_INTERACTIONS_ORPHAN_GRACE_S": "2"},
    ) as running:
        yield running


ORPHANED = "the run never parked on it"


def prompt(label: str) -> str:
    return f"{label} {uuid.uuid4().hex}"


def client(stack: ExecStack, tenant: Tenant) -> TetherClient:
    return TetherClient(stack.addr("gateway"), tenant.api_key)


async def interaction(stack: ExecStack, interaction_id: str) -> Any:
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            return (
                await conn.execute(
                    select(interactions).where(interactions.c.interaction_id == interaction_id)
                )
            ).one()
    finally:
        await engine.dispose()


async def swept_row(stack: ExecStack, interaction_id: str) -> Any:
    """The interaction once it is no longer pending, else None."""
    row = await interaction(stack, interaction_id)
    return row if row.status != "pending" else None


async def run_interactions(stack: ExecStack, run_id: str) -> list[Any]:
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            return list(
                (
                    await conn.execute(select(interactions).where(interactions.c.run_id == run_id))
                ).all()
            )
    finally:
        await engine.dispose()


async def make_overdue(stack: ExecStack, interaction_id: str) -> None:
    """Move an interaction's expiry into the past, as if its TTL had run out."""
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                update(interactions)
                .where(interactions.c.interaction_id == interaction_id)
                .values(expires_at=interactions.c.created_at)
            )
    finally:
        await engine.dispose()


async def outcome(call: Awaitable[Any]) -> grpc.StatusCode:
    """The status a call ended with."""
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def one_result_per_call(stack: ExecStack, run_id: str) -> None:
    """Every stored tool_use has exactly one tool_result."""
    parts = await parts_of(stack.db_url, run_id)
    calls = [p.payload["toolCallId"] for p in parts if p.kind == "tool_call"]
    results = Counter(p.payload["toolCallId"] for p in parts if p.kind == "tool_result")
    assert calls, "the run made a tool call"
    assert {c: results[c] for c in calls} == dict.fromkeys(calls, 1), "one tool_result per call"
    assert set(results) <= set(calls), "no tool_result without its call"


async def orphan_approval_refused_and_swept(
    stack: ExecStack, tc: TetherClient, run_id: str, orphan: str
) -> Any:
    """A run parked on its question: deciding the orphan approval is refused and changes
    nothing, the run shows no pending approval, and once overdue the orphan is swept (never
    expiring the run). The swept row."""
    decided = await outcome(tc.decide(run_id, "allow-once"))
    after = (await run_row(stack.db_url, run_id)).status
    assert (decided, after) == (grpc.StatusCode.FAILED_PRECONDITION, "waiting-for-question")
    assert not (await tc.pending_approval(run_id)).HasField("approval"), (
        "the run waits on its question, not on the orphan"
    )
    await make_overdue(stack, orphan)
    row = await eventually(
        lambda: swept_row(stack, orphan), timeout=10, interval=0.1, what="the orphan swept"
    )
    assert (row.status, row.reason) == ("orphaned", ORPHANED)
    assert (await run_row(stack.db_url, run_id)).status == "waiting-for-question"
    return row


class DeadWorker:
    """The worker's credential in the test's hands: a lease, interactions stored under it, and
    no park."""

    def __init__(self, stack: ExecStack) -> None:
        self._stack = stack

    async def __aenter__(self) -> DeadWorker:
        self._orch_channel = internal_channel(
            self._stack.addr("orchestrator"), self._stack.credentials["worker"]
        )
        self._int_channel = internal_channel(
            self._stack.addr("interactions"), self._stack.credentials["worker"]
        )
        self.orchestrator = orchestrator_pb2_grpc.OrchestratorServiceStub(self._orch_channel)
        self.store = interactions_pb2_grpc.InteractionsServiceStub(self._int_channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._orch_channel.close()
        await self._int_channel.close()

    async def lease(self, run_id: str) -> int:
        lease = (
            await self.orchestrator.ClaimRun(
                orchestrator_pb2.ClaimRunRequest(worker_id="dead-worker", wait_ms=5000)
            )
        ).lease
        assert lease.run_id == run_id
        return int(lease.epoch)

    async def approval(self, run_id: str, epoch: int, call_id: str, text: str) -> str:
        request = interactions_pb2.RequestApprovalRequest(
            run_id=run_id,
            epoch=epoch,
            tool_call_id=call_id,
            tool_name="publish_post",
            risk_category="publish",
            summary=f"Publish {text}",
            idempotency_key=f"k-{call_id}",
        )
        request.input.update({"text": text})
        return str((await self.store.RequestApproval(request)).interaction_id)

    async def park(self, run_id: str, epoch: int, interaction_id: str) -> None:
        await self.orchestrator.ParkRun(
            orchestrator_pb2.ParkRunRequest(
                run_id=run_id,
                epoch=epoch,
                status=common_pb2.RUN_STATUS_WAITING_FOR_APPROVAL,
                interaction_id=interaction_id,
            )
        )

    async def claim(self, run_id: str, epoch: int, call_id: str) -> Any:
        return await self.store.ClaimApproval(
            interactions_pb2.ClaimApprovalRequest(
                run_id=run_id, epoch=epoch, tool_name="publish_post", tool_call_id=call_id
            )
        )


async def test_an_approval_stored_by_a_worker_killed_before_it_parked_stays_inert(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant()
    text = prompt("killed before the park")
    stack.model.script(
        text,
        [
            ToolUseTurn("publish_post", {"text": "We launch today"}, delay_ms=300),
            ToolUseTurn("ask_questions", {"questions": [{"key": "city", "prompt": "Which?"}]}),
            TextTurn("Lisbon it is."),
        ],
    )
    await stack.services.stop("worker")
    # No checkpoint but the one before the park: the first checkpoint to wait on the held row.
    doomed = await stack.start_worker(TETHER_WORKER_CHECKPOINT_INTERVAL_S="30")
    run_id = await tenant.send(text)

    # Held only once the worker streams the call: a claim skips a locked row.
    async def streaming() -> bool:
        return any(r.script_key == text for r in stack.model.requests)

    await eventually(streaming, what="the model call")
    async with RowHold(stack.db_url, run_id) as hold:
        # The approval is stored; the checkpoint before the park waits on the row.
        await hold.lined_up(CHECKPOINT)
        [orphan] = [row.interaction_id for row in await run_interactions(stack, run_id)]
        stack.services.kill(doomed)
    # The lease runs out, the reaper requeues the run, and a live worker takes it.
    await stack.start_worker()
    await wait_for_status(stack.db_url, run_id, "waiting-for-question", timeout=30)
    async with client(stack, tenant) as tc:
        row = await orphan_approval_refused_and_swept(stack, tc, run_id, orphan)
        await tc.answer(run_id, {"city": ["Lisbon"]})
    run = await wait_for_status(stack.db_url, run_id, "completed")
    assert run.result_text == "Lisbon it is."
    assert row.decision is None and row.decided_by is None
    await one_result_per_call(stack, run_id)


async def test_an_orphan_approval_neither_wakes_nor_expires_a_run_parked_on_a_question(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant()
    text = prompt("orphan approval, then a question")
    stack.model.script(
        text,
        [
            ToolUseTurn("ask_questions", {"questions": [{"key": "city", "prompt": "Which?"}]}),
            TextTurn("Lisbon it is."),
        ],
    )
    await stack.services.stop("worker")
    try:
        run_id = await tenant.send(text)
        async with DeadWorker(stack) as dead:
            epoch = await dead.lease(run_id)
            orphan = await dead.approval(run_id, epoch, "toolu_orphan", "orphaned text")
            orphan_question = await dead.store.AskQuestions(
                interactions_pb2.AskQuestionsRequest(
                    run_id=run_id,
                    epoch=epoch,
                    tool_call_id="toolu_orphan_question",
                    questions=[interactions_pb2.QuestionSpec(key="city", prompt="Orphaned?")],
                )
            )
        # The dead worker's lease runs out; the reaper requeues the run for a live worker.
    finally:
        await stack.start_worker()
    await wait_for_status(stack.db_url, run_id, "waiting-for-question", timeout=30)
    async with client(stack, tenant) as tc:
        row = await orphan_approval_refused_and_swept(stack, tc, run_id, orphan)
        question = (await tc.pending_question(run_id)).question
        assert question.interaction_id != orphan_question.interaction_id
        question_row = await eventually(
            lambda: swept_row(stack, orphan_question.interaction_id),
            timeout=10,
            interval=0.1,
            what="the orphan question to be swept",
        )
        assert (question_row.status, question_row.reason) == ("orphaned", ORPHANED)
        assert (await tc.answer(run_id, {"city": ["Lisbon"]})).interaction_id == (
            question.interaction_id
        )
    run = await wait_for_status(stack.db_url, run_id, "completed")
    assert run.result_text == "Lisbon it is."
    assert row.decision is None and row.decided_by is None
    await one_result_per_call(stack, run_id)


async def test_an_orphan_consent_neither_completes_nor_fails_a_run_parked_on_its_own(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant()
    text = prompt("orphan consent, then a real one")
    stack.model.script(text, [ToolUseTurn("calendar_list_events"), TextTurn("You have two.")])
    await stack.services.stop("worker")
    try:
        run_id = await tenant.send(text)
        async with DeadWorker(stack) as dead:
            epoch = await dead.lease(run_id)
            offer = await dead.store.RequestConnection(
                interactions_pb2.RequestConnectionRequest(
                    run_id=run_id,
                    epoch=epoch,
                    tool_call_id="toolu_orphan",
                    provider="democal",
                    gap=interactions_pb2.CONNECTION_GAP_ABSENT,
                    scopes=["calendar.read"],
                )
            )
    finally:
        await stack.start_worker()
    await wait_for_status(stack.db_url, run_id, "waiting-for-connection", timeout=30)
    orphan_state = offer.login_url.split("state=")[1].split("&")[0]
    async with client(stack, tenant) as tc:
        bound = (await tc.pending_connection(run_id)).connection
        assert bound.interaction_id != offer.interaction_id
        completed = await outcome(
            tc.complete_connection(run_id, orphan_state, stack.oauth.code_for("calendar.read"))
        )
        after = (await run_row(stack.db_url, run_id)).status
        assert (completed, after) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "waiting-for-connection",
        )
        await make_overdue(stack, offer.interaction_id)

        row = await eventually(
            lambda: swept_row(stack, offer.interaction_id),
            timeout=10,
            interval=0.1,
            what="the orphan swept",
        )
        assert (row.status, row.reason) == ("orphaned", ORPHANED)
        assert (await run_row(stack.db_url, run_id)).status == "waiting-for-connection"
        state = bound.login_url.split("state=")[1].split("&")[0]
        assert (
            await tc.complete_connection(run_id, state, stack.oauth.code_for("calendar.read"))
        ).resumed
    run = await wait_for_status(stack.db_url, run_id, "completed")
    assert run.result_text == "You have two."
    await one_result_per_call(stack, run_id)


async def test_the_claim_takes_the_approval_of_this_tool_call(stack: ExecStack) -> None:
    """Two decided approvals for one tool in one run (the first pause's resumed attempt died
    before claiming), plus an orphan stored first: the claim takes this call's."""
    tenant = await stack.tenant()
    text = prompt("two pauses for one tool")
    await stack.services.stop("worker")  # this test holds every lease itself
    try:
        run_id = await tenant.send(text)
        async with DeadWorker(stack) as dead, client(stack, tenant) as tc:
            epoch = await dead.lease(run_id)
            orphan = await dead.approval(run_id, epoch, "toolu_orphan", "orphaned text")
            first = await dead.approval(run_id, epoch, "toolu_first", "first text")
            await dead.park(run_id, epoch, first)
            assert (await tc.pending_approval(run_id)).approval.interaction_id == first
            assert (await tc.decide(run_id, "allow-once")).interaction_id == first
            # The run is queued: nothing to decide (the orphan is not open for a decision).
            again = await outcome(tc.decide(run_id, "allow-once"))
            assert again == grpc.StatusCode.FAILED_PRECONDITION
            epoch = await dead.lease(run_id)  # resumed, and this attempt dies before claiming
            second = await dead.approval(run_id, epoch, "toolu_second", "second text")
            await dead.park(run_id, epoch, second)
            assert (await tc.decide(run_id, "allow-once")).interaction_id == second
            epoch = await dead.lease(run_id)
            claimed = await dead.claim(run_id, epoch, "toolu_second")
            assert claimed.claimed
            assert (claimed.interaction_id, claimed.tool_call_id) == (second, "toolu_second")
            assert dict(claimed.input) == {"text": "second text"}
            assert not (await dead.claim(run_id, epoch, "toolu_orphan")).claimed
            assert not (await dead.claim(run_id, epoch, "toolu_second")).claimed, "once"
            assert (await interaction(stack, orphan)).status == "pending"
            assert (await interaction(stack, first)).status == "decided", "still unclaimed"
    finally:
        await stack.start_worker()


async def test_a_tool_outside_the_allowlist_never_produces_an_approval(stack: ExecStack) -> None:
    tenant = await stack.tenant()
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.begin() as conn:
            agent = (
                await conn.execute(
                    select(tenants.c.agent).where(tenants.c.tenant_id == tenant.tenant_id)
                )
            ).scalar_one()
            allowlist = [t for t in TOOLS if t != "publish_post"]
            await conn.execute(
                update(tenants)
                .where(tenants.c.tenant_id == tenant.tenant_id)
                .values(agent={**agent, "tool_allowlist": allowlist})
            )
    finally:
        await engine.dispose()
    text = prompt("publish without the tool")
    stack.model.script(
        text,
        [
            ToolUseTurn("publish_post", {"text": "direct"}),
            ToolUseTurn(
                "request_approval", {"tool_name": "publish_post", "input": {"text": "asked"}}
            ),
            TextTurn("I cannot publish here."),
        ],
    )
    run_id = await tenant.send(text)
    run = await wait_for_status(stack.db_url, run_id, "completed", "waiting-for-approval")
    assert run.status == "completed"
    assert run.result_text == "I cannot publish here."
    assert await run_interactions(stack, run_id) == []
    results = [p.payload for p in await parts_of(stack.db_url, run_id) if p.kind == "tool_result"]
    assert len(results) == 2
    assert all(r["isError"] and "not available" in r["content"] for r in results)
    assert stack.ledger.records == [] or all(
        r.body["text"] not in ("direct", "asked") for r in stack.ledger.records
    )
    await one_result_per_call(stack, run_id)


async def test_a_malformed_question_gets_exactly_one_tool_result(stack: ExecStack) -> None:
    tenant = await stack.tenant()
    text = prompt("ask nothing")
    stack.model.script(
        text, [ToolUseTurn("ask_questions", {"questions": []}), TextTurn("Never mind.")]
    )
    run_id = await tenant.send(text)
    run = await wait_for_status(stack.db_url, run_id, "completed", "failed")
    await one_result_per_call(stack, run_id)
    assert run.status == "completed" and run.result_text == "Never mind."
    (result,) = [p.payload for p in await parts_of(stack.db_url, run_id) if p.kind == "tool_result"]
    assert result["isError"] and "needs a list of questions" in result["content"]


async def test_an_answer_stored_but_never_delivered_resumes_its_run_once(
    stack: ExecStack,
) -> None:
    """The state an interactions service leaves when it dies between recording an answer and
    resuming the run: the redelivery sweep resumes it, once."""
    tenant = await stack.tenant()
    text = prompt("answered, then the service died")
    stack.model.script(
        text,
        [
            ToolUseTurn("ask_questions", {"questions": [{"key": "ok", "prompt": "Go?"}]}),
            TextTurn("Going."),
        ],
    )
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "waiting-for-question")
    (pending,) = await run_interactions(stack, run_id)
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                update(interactions)
                .where(interactions.c.interaction_id == pending.interaction_id)
                .values(
                    status="answered",
                    answers={"ok": ["yes"]},
                    resolved_at=interactions.c.created_at,
                )
            )
    finally:
        await engine.dispose()
    run = await wait_for_status(stack.db_url, run_id, "completed")
    assert run.result_text == "Going."
    assert (await interaction(stack, pending.interaction_id)).delivered_at is not None
    await one_result_per_call(stack, run_id)
