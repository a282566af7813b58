"""Questions, approvals and connections with the services as real processes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from sqlalchemy import func, insert, select
from sqlalchemy import text as sql

from tests.system.execution_support import (
    ExecStack,
    Tenant,
    events_of,
    exec_stack,
    parts_of,
    run_row,
    wait_for_status,
)
from tether.client import TetherClient
from tether.db.engine import create_engine
from tether.db.schema import audit_log, connections, grants, interactions
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


THREE_QUESTIONS = {
    "questions": [
        {"key": "size", "prompt": "Which size?", "options": ["S", "M", "L"]},
        {
            "key": "colours",
            "prompt": "Which colours?",
            "options": ["red", "blue", "green"],
            "multiple": True,
        },
        {"key": "note", "prompt": "Anything else?"},
    ]
}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ExecStack]:
    run_dir = Path(tmp_path_factory.mktemp("interactions"))
    async with exec_stack(pg_server_url, template_db, redis_url, run_dir, workers=1) as running:
        yield running


def prompt(label: str) -> str:
    return f"{label} {uuid.uuid4().hex}"


async def parked_on_question(
    stack: ExecStack, label: str, questions: dict[str, Any], answer: str
) -> tuple[Tenant, str, str]:
    """A run that asks `questions`, then answers `answer`, parked on its question:
    (tenant, its text, run id)."""
    tenant = await stack.tenant()
    text = prompt(label)
    stack.model.script(text, [ToolUseTurn("ask_questions", questions), TextTurn(answer)])
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "waiting-for-question")
    return tenant, text, run_id


def client(stack: ExecStack, tenant: Tenant) -> TetherClient:
    return TetherClient(stack.addr("gateway"), tenant.api_key)


async def count(stack: ExecStack, table: Any, **where: Any) -> int:
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            stmt = select(func.count()).select_from(table)
            for key, value in where.items():
                stmt = stmt.where(getattr(table.c, key) == value)
            return int((await conn.execute(stmt)).scalar_one())
    finally:
        await engine.dispose()


async def connection_rows(stack: ExecStack, tenant_id: str) -> list[str]:
    """Each of the tenant's connections: 'sealed', or what gives its token away."""
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            rows = (
                await conn.execute(
                    sql(
                        "SELECT c::text, c.access_token, c.token_ciphertext IS NOT NULL "
                        "FROM connections c WHERE tenant_id = :t"
                    ),
                    {"t": tenant_id},
                )
            ).all()
    finally:
        await engine.dispose()
    # The demo provider's tokens start tok_ (tether.testing.oauth); a bytea reads as hex.
    return [
        "sealed" if sealed and not plain and "tok_" not in whole else whole
        for whole, plain, sealed in rows
    ]


async def test_three_questions_resume_once_and_the_model_is_not_asked_again(
    stack: ExecStack,
) -> None:
    tenant, text, run_id = await parked_on_question(
        stack, "order a shirt", THREE_QUESTIONS, "Ordering a M shirt in red and blue."
    )
    async with client(stack, tenant) as tc:
        pending = (await tc.pending_question(run_id)).question
        assert [q.key for q in pending.questions] == ["size", "colours", "note"]
        assert [q.multiple for q in pending.questions] == [False, True, False]
        assert list(pending.questions[2].options) == [] and not pending.questions[2].allow_other
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await tc.answer(run_id, {"size": ["XL"], "colours": ["red"], "note": ["-"]})
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not one of the options" in (bad.value.details() or "")
        answered = await tc.answer(
            run_id, {"size": ["M"], "colours": ["red", "blue"], "note": ["gift wrap"]}
        )
        assert answered.resumed
        assert await count(stack, audit_log, run_id=run_id, action="question.answered") == 1
        with pytest.raises(grpc.aio.AioRpcError) as again:
            await tc.answer(run_id, {"size": ["L"], "colours": ["red"], "note": ["x"]})
        assert again.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        run = await wait_for_status(stack.db_url, run_id, "completed")
        assert not (await tc.pending_question(run_id)).HasField("question")
    assert run.result_text == "Ordering a M shirt in red and blue."
    asks = [
        p
        for p in await parts_of(stack.db_url, run_id)
        if p.kind == "tool_call" and p.payload["name"] == "ask_questions"
    ]
    assert len(asks) == 1, "the model was not asked again"
    last_request = [r for r in stack.model.requests if r.script_key == text][-1]
    answer_line = json.dumps(last_request.body["messages"][-1])
    assert last_request.body["messages"][-1]["role"] == "user"
    assert "gift wrap" in answer_line and "red, blue" in answer_line
    seen = [t for _, t, _ in await events_of(stack.db_url, run_id)]
    assert seen.count("question.requested") == 1 and seen.count("question.answered") == 1


async def test_a_gated_tool_parks_for_approval_and_never_runs_without_one(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant()
    text = prompt("publish something")
    stack.model.script(text, [ToolUseTurn("publish_post", {"text": "Hello world"})])
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "waiting-for-approval")
    async with client(stack, tenant) as tc:
        approval = (await tc.pending_approval(run_id)).approval
    assert approval.tool_name == "publish_post"
    assert approval.risk_category == "publish"
    assert dict(approval.input) == {"text": "Hello world"}
    assert "Hello world" in approval.summary
    assert "allow-once" in approval.allowed_decisions
    assert stack.ledger.records == [], "nothing was published while waiting"


async def test_allow_once_runs_the_stored_input_exactly_once_and_mints_no_grant(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant()
    text = prompt("publish the stored one")
    before = len(stack.ledger.records)
    stack.model.script(
        text,
        [
            ToolUseTurn("publish_post", {"text": "Stored text"}),
            # After the resume the model "would now" ask for something else: not run.
            ToolUseTurn("publish_post", {"text": "Regenerated text"}),
        ],
    )
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "waiting-for-approval")
    async with client(stack, tenant) as tc:
        decided = await tc.decide(run_id, "allow-once")
    assert decided.resumed and decided.grant_id == ""
    await wait_for_status(stack.db_url, run_id, "waiting-for-approval")  # parked again for B
    published = stack.ledger.records[before:]
    assert [r.body["text"] for r in published] == ["Stored text"]
    assert await count(stack, grants, tenant_id=tenant.tenant_id) == 0
    async with client(stack, tenant) as tc:
        approval = (await tc.pending_approval(run_id)).approval
    assert dict(approval.input) == {"text": "Regenerated text"}, "a new call needs a new approval"


async def test_a_denied_approval_is_claimed_and_never_retried(stack: ExecStack) -> None:
    tenant = await stack.tenant()
    text = prompt("publish and be denied")
    before = len(stack.ledger.records)
    stack.model.script(
        text, [ToolUseTurn("publish_post", {"text": "No"}), TextTurn("Understood, not publishing.")]
    )
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "waiting-for-approval")
    async with client(stack, tenant) as tc:
        await tc.decide(run_id, "deny")
    run = await wait_for_status(stack.db_url, run_id, "completed")
    assert run.result_text == "Understood, not publishing."
    assert len(stack.ledger.records) == before
    (result,) = [p for p in await parts_of(stack.db_url, run_id) if p.kind == "tool_result"]
    assert result.payload["isError"] and "denied" in result.payload["content"]
    assert await count(stack, interactions, run_id=run_id, status="claimed") == 1
    # The decision is on the audit trail: who decided which interaction, how.
    audited = await count(stack, audit_log, run_id=run_id, action="approval.decided")
    assert audited == 1, "a decision leaves one audit row"


async def test_allow_conversation_mints_a_grant_for_later_calls(stack: ExecStack) -> None:
    tenant = await stack.tenant()
    conversation = f"conv-{uuid.uuid4().hex[:8]}"
    text = prompt("publish twice")
    stack.model.script(
        text,
        [
            ToolUseTurn("publish_post", {"text": "one"}),
            TextTurn("ok"),
            ToolUseTurn("publish_post", {"text": "two"}),
            TextTurn("ok"),
        ],
    )
    run_id = await tenant.send(text, conversation)
    await wait_for_status(stack.db_url, run_id, "waiting-for-approval")
    async with client(stack, tenant) as tc:
        decided = await tc.decide(run_id, "allow-conversation")
    assert decided.grant_id
    await wait_for_status(stack.db_url, run_id, "completed")
    follow_up = await tenant.send("and again", conversation)
    await wait_for_status(stack.db_url, follow_up, "completed")
    assert {r.body["text"] for r in stack.ledger.records} >= {"one", "two"}


async def test_allow_always_needs_tenant_policy_for_wider_scopes(stack: ExecStack) -> None:
    tenant = await stack.tenant()
    text = prompt("publish always")
    stack.model.script(text, [ToolUseTurn("publish_post", {"text": "always"}), TextTurn("ok")])
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "waiting-for-approval")
    async with client(stack, tenant) as tc:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await tc.decide(run_id, "allow-always", "tenant")
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        decided = await tc.decide(run_id, "allow-always", "principal")
    assert decided.grant_id
    await wait_for_status(stack.db_url, run_id, "completed")


async def test_two_claimers_racing_for_one_approval_get_one_claim(stack: ExecStack) -> None:
    tenant = await stack.tenant()
    text = prompt("race the claim")
    stack.model.script(text, [ToolUseTurn("publish_post", {"text": "race"})])
    await stack.services.stop("worker")  # this test holds the lease itself
    try:
        run_id = await tenant.send(text)
        async with (
            internal_channel(
                stack.addr("orchestrator"), stack.credentials["worker"]
            ) as orch_channel,
            internal_channel(
                stack.addr("interactions"), stack.credentials["worker"]
            ) as int_channel,
        ):
            orchestrator = orchestrator_pb2_grpc.OrchestratorServiceStub(orch_channel)
            store = interactions_pb2_grpc.InteractionsServiceStub(int_channel)
            lease = (
                await orchestrator.ClaimRun(
                    orchestrator_pb2.ClaimRunRequest(worker_id="t", wait_ms=5000)
                )
            ).lease
            assert lease.run_id == run_id
            request = interactions_pb2.RequestApprovalRequest(
                run_id=run_id,
                epoch=lease.epoch,
                tool_call_id="toolu_x",
                tool_name="publish_post",
                risk_category="publish",
                idempotency_key="k",
            )
            request.input.update({"text": "race"})
            approval = await store.RequestApproval(request)
            undecided = await store.ClaimApproval(
                interactions_pb2.ClaimApprovalRequest(
                    run_id=run_id,
                    epoch=lease.epoch,
                    tool_name="publish_post",
                    tool_call_id="toolu_x",
                )
            )
            assert not undecided.claimed, "an undecided approval cannot be claimed"
            await orchestrator.ParkRun(
                orchestrator_pb2.ParkRunRequest(
                    run_id=run_id,
                    epoch=lease.epoch,
                    status=common_pb2.RUN_STATUS_WAITING_FOR_APPROVAL,
                    interaction_id=approval.interaction_id,
                )
            )
            async with client(stack, tenant) as tc:
                await tc.decide(run_id, "allow-once")
            lease = (
                await orchestrator.ClaimRun(
                    orchestrator_pb2.ClaimRunRequest(worker_id="t", wait_ms=5000)
                )
            ).lease
            other_tool = await store.ClaimApproval(
                interactions_pb2.ClaimApprovalRequest(
                    run_id=run_id, epoch=lease.epoch, tool_name="get_time", tool_call_id="toolu_x"
                )
            )
            assert not other_tool.claimed, "a claim for one tool does not authorise another"
            claims = await asyncio.gather(
                *(
                    store.ClaimApproval(
                        interactions_pb2.ClaimApprovalRequest(
                            run_id=run_id,
                            epoch=lease.epoch,
                            tool_name="publish_post",
                            tool_call_id="toolu_x",
                        )
                    )
                    for _ in range(10)
                )
            )
            assert sum(c.claimed for c in claims) == 1
            with pytest.raises(grpc.aio.AioRpcError) as stale:
                await store.ClaimApproval(
                    interactions_pb2.ClaimApprovalRequest(
                        run_id=run_id,
                        epoch=lease.epoch - 1,
                        tool_name="publish_post",
                        tool_call_id="toolu_x",
                    )
                )
            assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        await stack.start_worker()


async def test_pending_interactions_survive_a_restart_of_every_service(
    stack: ExecStack,
) -> None:
    tenant, _, run_id = await parked_on_question(
        stack,
        "ask then restart",
        {"questions": [{"key": "city", "prompt": "Which city?"}]},
        "Booked in Lisbon.",
    )
    await stack.services.stop_all()
    await stack.services.start_all()
    async with client(stack, tenant) as tc:
        pending = (await tc.pending_question(run_id)).question
        assert [q.key for q in pending.questions] == ["city"]
        await tc.answer(run_id, {"city": ["Lisbon"]})
    run = await wait_for_status(stack.db_url, run_id, "completed")
    assert run.result_text == "Booked in Lisbon."


async def test_consent_completes_once_and_a_leaked_url_is_useless_to_another_tenant(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant()
    stranger = await stack.tenant()
    text = prompt("what is on my calendar")
    stack.model.script(text, [ToolUseTurn("calendar_list_events"), TextTurn("You have two.")])
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "waiting-for-connection")
    async with client(stack, tenant) as tc:
        offer = (await tc.pending_connection(run_id)).connection
    assert offer.provider == "democal"
    assert offer.gap == interactions_pb2.CONNECTION_GAP_ABSENT
    state = offer.login_url.split("state=")[1].split("&")[0]
    code = stack.oauth.code_for("calendar.read")
    async with client(stack, stranger) as other:
        with pytest.raises(grpc.aio.AioRpcError) as leaked:
            await other.complete_connection(run_id, state, code)
        with pytest.raises(grpc.aio.AioRpcError) as absent:
            await other.complete_connection("run_" + "0" * 32, state, code)
    assert leaked.value.code() == absent.value.code() == grpc.StatusCode.NOT_FOUND
    assert (leaked.value.details() or "").replace(run_id, "X") == (
        absent.value.details() or ""
    ).replace("run_" + "0" * 32, "X")
    async with client(stack, tenant) as tc:
        first = await tc.complete_connection(run_id, state, code)
        second = await tc.complete_connection(run_id, state, stack.oauth.code_for("x"))
    assert (first.resumed, second.resumed) == (True, False)
    assert await count(stack, audit_log, run_id=run_id, action="connection.completed") == 1
    run = await wait_for_status(stack.db_url, run_id, "completed")
    assert run.result_text == "You have two."
    assert [t for _, t, _ in await events_of(stack.db_url, run_id)].count("run.queued") == 2
    # The run used the token, opened from its sealed form; the table never shows it.
    assert await connection_rows(stack, tenant.tenant_id) == ["sealed"]


async def test_a_plaintext_token_from_the_previous_release_is_used_then_sealed(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant()
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                insert(connections).values(
                    tenant_id=tenant.tenant_id,
                    principal_id="tester",
                    provider="democal",
                    scopes=["calendar.read"],
                    access_token="tok_stored-by-the-previous-release",
                    expires_at=datetime.now(UTC) + timedelta(hours=1),
                )
            )
    finally:
        await engine.dispose()
    text = prompt("calendar with an old token")
    stack.model.script(text, [ToolUseTurn("calendar_list_events"), TextTurn("Two events.")])
    run_id = await tenant.send(text)
    run = await wait_for_status(stack.db_url, run_id, "completed")
    assert run.result_text == "Two events."
    assert await connection_rows(stack, tenant.tenant_id) == ["sealed"]


async def test_cli_answer_decide_and_connect_drive_paused_runs(
    stack: ExecStack, tmp_path: Path
) -> None:
    tenant = await stack.tenant()
    stack_file = tmp_path / "stack.json"
    stack_file.write_text(json.dumps({"gateway": stack.addr("gateway"), "api_key": tenant.api_key}))

    def cli(*args: str) -> dict[str, Any]:
        done = subprocess.run(
            [sys.executable, "-m", "tether.cli", *args, "--json", "--stack", str(stack_file)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return dict(json.loads(done.stdout.splitlines()[-1]))

    asked, approve, connect = prompt("cli ask"), prompt("cli approve"), prompt("cli connect")
    stack.model.script(
        asked,
        [
            ToolUseTurn(
                "ask_questions",
                {"questions": [{"key": "day", "prompt": "Which day?", "options": ["mon", "tue"]}]},
            ),
            TextTurn("ok"),
        ],
    )
    stack.model.script(approve, [ToolUseTurn("publish_post", {"text": "cli"}), TextTurn("ok")])
    stack.model.script(connect, [ToolUseTurn("calendar_list_events"), TextTurn("ok")])
    runs = {
        label: await tenant.send(text)
        for label, text in (("ask", asked), ("approve", approve), ("connect", connect))
    }
    await wait_for_status(stack.db_url, runs["ask"], "waiting-for-question")
    shown = await asyncio.to_thread(cli, "answer", runs["ask"])
    assert shown["question"]["questions"][0]["key"] == "day"
    assert (await asyncio.to_thread(cli, "answer", runs["ask"], "day=tue"))["resumed"] is True
    await wait_for_status(stack.db_url, runs["approve"], "waiting-for-approval")
    decided = await asyncio.to_thread(cli, "decide", runs["approve"], "allow-once")
    assert decided["resumed"] is True and decided["grant_id"] == ""
    await wait_for_status(stack.db_url, runs["connect"], "waiting-for-connection")
    url = (await asyncio.to_thread(cli, "connect", runs["connect"]))["login_url"]
    assert url.startswith(stack.oauth.base_url)
    done = await asyncio.to_thread(cli, "connect", runs["connect"], "--complete")
    assert done["resumed"] is True
    for run_id in runs.values():
        await wait_for_status(stack.db_url, run_id, "completed")
    assert (await run_row(stack.db_url, runs["approve"])).status == "completed"


async def test_an_expired_consent_fails_the_run_with_its_reason(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path: Path
) -> None:
    async with exec_stack(
        pg_server_url,
        template_db,
        redis_url,
        tmp_path,
        workers=1,
        extra_env={"TETHER_INTERACTIONS_CONSENT_TTL_S": "1"},
    ) as stack:
        tenant = await stack.tenant()
        text = prompt("calendar, then walk away")
        stack.model.script(text, [ToolUseTurn("calendar_list_events")])
        run_id = await tenant.send(text)
        await wait_for_status(stack.db_url, run_id, "waiting-for-connection")
        run = await wait_for_status(stack.db_url, run_id, "failed", timeout=15)
        assert run.error["code"] == "connection_expired"
        assert "democal" in run.error["message"]
        outcomes = [
            p.get("outcome")
            for _, t, p in await events_of(stack.db_url, run_id)
            if t == "connection.completed"
        ]
        assert outcomes == ["expired"]


async def test_without_a_login_url_a_connection_gap_fails_naming_the_credential(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path: Path
) -> None:
    # No OAuth provider configured: a token integration has nowhere to send a person.
    async with exec_stack(
        pg_server_url,
        template_db,
        redis_url,
        tmp_path,
        workers=1,
        extra_env={"TETHER_INTERACTIONS_OAUTH_BASE_URL": ""},
    ) as stack:
        tenant = await stack.tenant()
        text = prompt("calendar without oauth")
        stack.model.script(text, [ToolUseTurn("calendar_list_events")])
        run_id = await tenant.send(text)
        run = await wait_for_status(stack.db_url, run_id, "failed")
        assert run.error["code"] == "connection_absent"
        assert "connection:democal/" in run.error["message"], "names the credential reference"


async def test_an_expired_approval_is_claimed_and_the_run_moves_on(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path: Path
) -> None:
    async with exec_stack(
        pg_server_url,
        template_db,
        redis_url,
        tmp_path,
        workers=1,
        extra_env={"TETHER_INTERACTIONS_APPROVAL_TTL_S": "1"},
    ) as stack:
        tenant = await stack.tenant()
        text = prompt("publish, then nobody decides")
        stack.model.script(
            text,
            [
                ToolUseTurn("publish_post", {"text": "late"}),
                TextTurn("Nobody approved; I did not publish."),
            ],
        )
        run_id = await tenant.send(text)
        await wait_for_status(stack.db_url, run_id, "waiting-for-approval")
        run = await wait_for_status(stack.db_url, run_id, "completed", timeout=20)
        assert run.result_text == "Nobody approved; I did not publish."
        assert stack.ledger.records == []
        (result,) = [p for p in await parts_of(stack.db_url, run_id) if p.kind == "tool_result"]
        assert result.payload["isError"] and "expired" in result.payload["content"]
        decided = [
            p["decision"]
            for _, t, p in await events_of(stack.db_url, run_id)
            if t == "approval.decided"
        ]
        assert decided == ["expired"]


async def test_cancelling_a_parked_run_closes_its_pause(stack: ExecStack) -> None:
    tenant = await stack.tenant()
    text = prompt("publish then cancel")
    stack.model.script(text, [ToolUseTurn("publish_post", {"text": "never"})])
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "waiting-for-approval")
    assert (await tenant.cancel(run_id)).changed
    await wait_for_status(stack.db_url, run_id, "cancelled")
    async with client(stack, tenant) as tc:
        assert not (await tc.pending_approval(run_id)).HasField("approval")
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await tc.decide(run_id, "allow-once")
    assert late.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    (result,) = [p for p in await parts_of(stack.db_url, run_id) if p.kind == "tool_result"]
    assert result.payload["isError"] and "cancelled" in result.payload["content"]
    assert stack.ledger.records == [] or all(
        r.body["text"] != "never" for r in stack.ledger.records
    )


async def test_an_answer_given_while_the_orchestrator_is_down_is_unavailable_then_resumes_once(
    stack: ExecStack,
) -> None:
    # Which pause a run is parked on is the orchestrator's to say: while it is down an answer
    # is refused as retryable (nothing recorded), and the same answer resumes the run later.
    tenant, _, run_id = await parked_on_question(
        stack,
        "answer during an outage",
        {"questions": [{"key": "ok", "prompt": "Proceed?"}]},
        "Proceeding.",
    )
    port = stack.services.procs["orchestrator"].port
    await stack.services.stop("orchestrator")
    try:
        async with client(stack, tenant) as tc:
            with pytest.raises(grpc.aio.AioRpcError) as down:
                await tc.answer(run_id, {"ok": ["yes"]})
        assert down.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "orchestrator is unreachable" in (down.value.details() or "")
        assert await count(stack, interactions, run_id=run_id, status="pending") == 1
    finally:
        await stack.services.start(
            "orchestrator", extra_env={"TETHER_ORCHESTRATOR_PORT": str(port)}
        )

    async def answered_once_back() -> bool | None:
        # The caller retries UNAVAILABLE, as a client does, until the orchestrator is back.
        async with client(stack, tenant) as tc:
            try:
                return bool((await tc.answer(run_id, {"ok": ["yes"]})).resumed)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                return None

    assert await eventually(answered_once_back, timeout=30, interval=0.2, what="the answer")
    run = await wait_for_status(stack.db_url, run_id, "completed", timeout=30)
    assert run.result_text == "Proceeding."
    seen = [t for _, t, _ in await events_of(stack.db_url, run_id)]
    assert seen.count("question.answered") == 1
