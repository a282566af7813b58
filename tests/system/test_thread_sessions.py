"""An external conversation id is a correlation value, never access to a conversation: with
the services as real processes, a principal naming another principal's provider thread opens a
conversation of its own. It is not authorised by the other's allow-conversation grant, and the
model is never sent the other's history.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from tests.system.execution_support import ExecStack, exec_stack, wait_for_status
from tether import apikeys
from tether.db.engine import create_engine
from tether.testing.model_server import TextTurn, ToolUseTurn
from tether.v1 import admission_pb2, gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="session")

# Scope names as strings: the regression test must also run against code that predates them.
SCOPES = ["runs:read", "runs:write", "interactions:write", "approvals:decide"]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ExecStack]:
    async with exec_stack(
        pg_server_url,
        template_db,
        redis_url,
        Path(tmp_path_factory.mktemp("thread-sessions")),
        workers=1,
    ) as running:
        yield running


async def principal_keys(stack: ExecStack, *principals: str) -> list[str]:
    """One key for each principal, all of one fresh tenant."""
    tenant = await stack.tenant()
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.begin() as conn:
            return [
                (await apikeys.create_key(conn, tenant.tenant_id, principal, SCOPES))[0]
                for principal in principals
            ]
    finally:
        await engine.dispose()


def metadata(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


async def in_thread(stack: ExecStack, key: str, thread: str, text: str) -> str:
    """A WhatsApp message in `thread`, delivered with `key`; its run id."""
    async with grpc.aio.insecure_channel(stack.addr("gateway")) as channel:
        response = await gateway_pb2_grpc.GatewayServiceStub(channel).SubmitEvent(
            gateway_pb2.SubmitEventRequest(
                messaging=admission_pb2.MessagingWebhookInput(
                    provider="whatsapp",
                    provider_event_id=f"wa-{uuid.uuid4().hex}",
                    sender_id="guest-1",
                    sender_type="guest",
                    thread_id=thread,
                    text=text,
                )
            ),
            metadata=metadata(key),
        )
    return str(response.run.run_id)


async def decide(stack: ExecStack, key: str, run_id: str, decision: str) -> str:
    """Decide the run's open approval; the standing grant it minted, if any."""
    async with grpc.aio.insecure_channel(stack.addr("gateway")) as channel:
        decided = await gateway_pb2_grpc.GatewayServiceStub(channel).DecideApproval(
            gateway_pb2.DecideApprovalRequest(run_id=run_id, decision=decision),
            metadata=metadata(key),
        )
    return str(decided.grant_id)


def publish(text: str) -> list[ToolUseTurn | TextTurn]:
    return [ToolUseTurn("publish_post", {"text": text}), TextTurn(f"Published: {text}")]


async def test_another_principal_naming_the_same_thread_gets_neither_grant_nor_history(
    stack: ExecStack,
) -> None:
    alice, bob = await principal_keys(stack, "alice-bridge", "bob-bridge")
    thread = f"th-{uuid.uuid4().hex[:8]}"
    alice_first = f"alice's secret launch plan {uuid.uuid4().hex}"
    alice_second = f"alice's second secret {uuid.uuid4().hex}"
    bob_text = f"bob asks to publish {uuid.uuid4().hex}"
    # The model server keys a request by its first user text, so a conversation's every run is
    # scripted under its first message: alice's two runs here. A third pair under that key
    # answers bob's run should it land in alice's conversation: it asks to publish either way.
    stack.model.script(
        alice_first, [*publish("alice 1"), *publish("alice 2"), *publish("bob in alice's")]
    )
    stack.model.script(bob_text, publish("bob's own"))

    first = await in_thread(stack, alice, thread, alice_first)
    await wait_for_status(stack.db_url, first, "waiting-for-approval")
    assert await decide(stack, alice, first, "allow-conversation")
    alices = (await wait_for_status(stack.db_url, first, "completed")).session_id
    # The grant holds in alice's conversation: her next run publishes without a pause.
    second = await in_thread(stack, alice, thread, alice_second)
    run = await wait_for_status(stack.db_url, second, "completed", "waiting-for-approval")
    assert (run.status, run.session_id) == ("completed", alices)

    def bobs_requests() -> list[str]:
        return [json.dumps(r.body) for r in stack.model.requests if bob_text in json.dumps(r.body)]

    def leaked() -> list[str]:
        secrets = (alice_first, alice_second, "Published: alice")
        return [s for s in secrets if any(s in body for body in bobs_requests())]

    bobs = await in_thread(stack, bob, thread, bob_text)
    run = await wait_for_status(stack.db_url, bobs, "waiting-for-approval", "completed", "failed")
    # Paused: alice's allow-conversation grant does not cover bob's call; and not one of bob's
    # model requests holds alice's words.
    assert (run.status, leaked()) == ("waiting-for-approval", []), (
        f"bob's run: {run.status}, sent {leaked()}"
    )
    assert run.session_id != alices
    await decide(stack, bob, bobs, "allow-once")
    await wait_for_status(stack.db_url, bobs, "completed")
    assert (len(bobs_requests()), leaked()) == (2, [])
    published = [record.body["text"] for record in stack.ledger.records]
    assert published == ["alice 1", "alice 2", "bob's own"]
    stack.model.drop_script(alice_first)
