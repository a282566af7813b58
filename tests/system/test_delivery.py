"""A channel run's answer goes back out through its channel, once (issue 30, stage 3), with the
services as real processes and the Slack and WhatsApp stand-ins as the providers: one threaded
reply carrying its delivery id in the message metadata, recorded before it is sent, reported by
`delivery.*` before `run.completed`; never twice, even when the worker is SIGKILLed after the
provider stored the post and before its answer came back; `unknown` rather than a second post
when the provider cannot be asked; Retry-After honoured; a refusal kept; the answer gated by the
agent's approvals; WhatsApp reconciled through its status callback."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from sqlalchemy import insert

from tests.system.delivery_support import Receiver, Rig, delivery_of, delivery_rig
from tests.system.execution_support import events_of, wait_for_status
from tether import apikeys
from tether.db.engine import create_engine
from tether.db.schema import channel_statuses
from tether.runtime.rpc import internal_channel
from tether.testing.model_server import TextTurn
from tether.testing.slack_server import ApiError, HttpFailure, RateLimited
from tether.v1 import (
    gateway_pb2,
    gateway_pb2_grpc,
    interactions_pb2_grpc,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
)
from tether.v1 import interactions_pb2 as ipb

pytestmark = pytest.mark.system


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def rig(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Rig]:
    run_dir = Path(tmp_path_factory.mktemp("delivery"))
    async with delivery_rig(pg_server_url, template_db, redis_url, run_dir) as rig:
        yield rig


@pytest_asyncio.fixture(loop_scope="session", autouse=True)
async def fresh_stand_ins(rig: Rig) -> AsyncIterator[None]:
    yield
    rig.slack.release_post_answers()
    rig.slack.clear_script()
    rig.whatsapp.release_answers()
    rig.whatsapp.clear_script()


def prompt(label: str) -> str:
    return f"{label} {uuid.uuid4().hex}"


def delivery_events(events: list[tuple[int, str, dict[str, Any]]]) -> list[str]:
    return [t for _, t, _ in events if t.startswith("delivery.") or t == "run.completed"]


def worker_of(rig: Rig) -> str:
    (name,) = [n for n in rig.stack.services.procs if n.startswith("worker")]
    return name


async def tether_json(rig: Rig, key: str, tmp_path: Path, *args: str) -> Any:
    """`tether ARGS --json` against the stack, as `key`; its JSON answer."""
    stack_file = tmp_path / f"stack-{uuid.uuid4().hex[:6]}.json"
    stack_file.write_text(json.dumps({"gateway": rig.stack.addr("gateway"), "api_key": key}))
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tether.cli",
        *args,
        "--json",
        "--stack",
        str(stack_file),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    return json.loads(out)


async def test_a_slack_run_gets_one_threaded_reply_carrying_its_delivery(
    rig: Rig, tmp_path: Path
) -> None:
    tenant = await rig.stack.tenant(scopes=(*apikeys.CLIENT_SCOPES, apikeys.RUNS_ALL))
    channel_id = await rig.add_channel(tenant, "slack")
    text = prompt("hello from slack")
    rig.stack.model.script(text, [TextTurn("Here is your answer.")])
    run_id, slack_channel, ts = await rig.slack_run(tenant, channel_id, text)
    run = await wait_for_status(rig.db_url, run_id, "completed", "failed", timeout=30)
    assert run.status == "completed"
    thread = rig.slack.thread(slack_channel, ts)
    assert [m.text for m in thread] == [text, "Here is your answer."]
    delivery = await delivery_of(rig.db_url, run_id)
    assert (delivery.state, delivery.channel_id, delivery.kind) == ("sent", channel_id, "slack")
    assert delivery.provider_message_id == thread[1].ts
    assert thread[1].metadata == {
        "event_type": "tether_delivery",
        "event_payload": {"delivery_id": delivery.delivery_id},
    }
    assert thread[1].thread_ts == ts
    events = await events_of(rig.db_url, run_id)
    assert delivery_events(events) == ["delivery.sent", "run.completed"]
    sent = next(p for _, t, p in events if t == "delivery.sent")
    assert sent["deliveryId"] == delivery.delivery_id
    assert sent["providerMessageId"] == thread[1].ts
    assert delivery.attempts == 1
    shown = await tether_json(rig, tenant.api_key, tmp_path, "run", run_id)
    assert {
        k: shown["delivery"].get(k) for k in ("state", "channel_id", "provider_message_id")
    } == {
        "state": "sent",
        "channel_id": channel_id,
        "provider_message_id": thread[1].ts,
    }
    assert "error" not in shown["delivery"]
    # A stream's snapshot (ReadEvents with its state, as the gateway reads it) carries it too.
    async with internal_channel(
        rig.stack.addr("orchestrator"), rig.stack.credentials["gateway"]
    ) as channel:
        read = await orchestrator_pb2_grpc.OrchestratorServiceStub(channel).ReadEvents(
            orchestrator_pb2.ReadEventsRequest(
                tenant_id=tenant.tenant_id, run_id=run_id, include_state=True, all_runs=True
            )
        )
    assert (read.run.delivery.state, read.run.delivery.delivery_id) == (
        "sent",
        delivery.delivery_id,
    )


async def test_a_worker_killed_after_slack_stored_the_post_never_posts_twice(rig: Rig) -> None:
    tenant = await rig.stack.tenant()
    channel_id = await rig.add_channel(tenant, "slack")
    text = prompt("kill me mid-post")
    rig.stack.model.script(text, [TextTurn("The one answer."), TextTurn("A second draft.")])
    rig.slack.hold_post_answers()
    run_id, slack_channel, ts = await rig.slack_run(tenant, channel_id, text)

    def held(calls: Any) -> bool:
        return any(
            c.method == "chat.postMessage"
            and c.outcome == "held"
            and c.params.get("channel") == slack_channel
            for c in calls
        )

    async with asyncio.timeout(30):
        await rig.slack.wait_until(held)
    # Stored at Slack, its answer not yet back at the worker: the crash window.
    assert (await delivery_of(rig.db_url, run_id)).state == "pending"
    worker = worker_of(rig)
    rig.stack.services.kill(worker)
    rig.slack.release_post_answers()
    await rig.stack.services.restart(worker)
    run = await wait_for_status(rig.db_url, run_id, "completed", "failed", timeout=60)
    assert (run.status, run.attempt) == ("completed", 2)
    replies = [m for m in rig.slack.thread(slack_channel, ts) if m.bot_id is not None]
    assert [m.text for m in replies] == ["The one answer."], "exactly one message in the thread"
    delivery = await delivery_of(rig.db_url, run_id)
    assert (delivery.state, delivery.provider_message_id) == ("sent", replies[0].ts)
    assert delivery.text == "The one answer."
    posts = [c for c in rig.slack.calls if c.method == "chat.postMessage"]
    assert len([c for c in posts if c.params.get("channel") == slack_channel]) == 1
    looked = [
        c
        for c in rig.slack.calls
        if c.method == "conversations.replies" and c.params.get("channel") == slack_channel
    ]
    assert looked, "the second attempt found its post again through the metadata"
    assert run.result_text == "The one answer."
    assert delivery_events(await events_of(rig.db_url, run_id)) == [
        "delivery.sent",
        "run.completed",
    ]


@pytest.mark.slow
async def test_every_service_killed_after_slack_stored_the_post_never_posts_twice(
    rig: Rig,
) -> None:
    tenant = await rig.stack.tenant()
    channel_id = await rig.add_channel(tenant, "slack")
    text = prompt("kill the whole stack mid-post")
    rig.stack.model.script(text, [TextTurn("Posted before the crash."), TextTurn("Not this.")])
    rig.slack.hold_post_answers()
    run_id, slack_channel, ts = await rig.slack_run(tenant, channel_id, text)
    async with asyncio.timeout(30):
        await rig.slack.wait_until(
            lambda calls: any(
                c.method == "chat.postMessage"
                and c.outcome == "held"
                and c.params.get("channel") == slack_channel
                for c in calls
            )
        )
    services = rig.stack.services
    names = list(services.procs)
    for name in names:
        services.kill(name)
    rig.slack.release_post_answers()
    for name in ("orchestrator", "interactions", "admission", "gateway"):
        await services.restart(name)
    for name in names:
        if name.startswith("worker"):
            await services.restart(name)
    run = await wait_for_status(rig.db_url, run_id, "completed", "failed", timeout=60)
    assert (run.status, run.attempt) == ("completed", 2)
    replies = [m for m in rig.slack.thread(slack_channel, ts) if m.bot_id is not None]
    assert [m.text for m in replies] == ["Posted before the crash."]
    delivery = await delivery_of(rig.db_url, run_id)
    assert (delivery.state, delivery.provider_message_id) == ("sent", replies[0].ts)


async def test_a_provider_that_cannot_be_asked_after_a_crash_leaves_the_delivery_unknown(
    rig: Rig,
) -> None:
    tenant = await rig.stack.tenant()
    channel_id = await rig.add_channel(tenant, "slack")
    text = prompt("cannot ask")
    rig.stack.model.script(text, [TextTurn("Maybe posted."), TextTurn("Another draft.")])
    rig.slack.hold_post_answers()
    run_id, slack_channel, ts = await rig.slack_run(tenant, channel_id, text)
    async with asyncio.timeout(30):
        await rig.slack.wait_until(
            lambda calls: any(
                c.method == "chat.postMessage"
                and c.outcome == "held"
                and c.params.get("channel") == slack_channel
                for c in calls
            )
        )
    worker = worker_of(rig)
    rig.stack.services.kill(worker)
    rig.slack.release_post_answers()
    rig.slack.script("conversations.replies", HttpFailure(503), times=None)
    await rig.stack.services.restart(worker)
    run = await wait_for_status(rig.db_url, run_id, "completed", "failed", timeout=60)
    assert run.status == "completed"
    delivery = await delivery_of(rig.db_url, run_id)
    assert delivery.state == "unknown"
    assert "not sent again" in delivery.error["message"]
    replies = [m for m in rig.slack.thread(slack_channel, ts) if m.bot_id is not None]
    assert len(replies) == 1, "one post, never a second"
    assert delivery_events(await events_of(rig.db_url, run_id)) == [
        "delivery.unknown",
        "run.completed",
    ]


async def test_a_rate_limited_post_waits_its_retry_after(rig: Rig) -> None:
    tenant = await rig.stack.tenant()
    channel_id = await rig.add_channel(tenant, "slack")
    text = prompt("rate limited")
    rig.stack.model.script(text, [TextTurn("After the wait.")])
    rig.slack.script("chat.postMessage", RateLimited(retry_after=2), times=1)
    run_id, slack_channel, _ = await rig.slack_run(tenant, channel_id, text)
    run = await wait_for_status(rig.db_url, run_id, "completed", "failed", timeout=30)
    assert run.status == "completed"
    posts = [
        c
        for c in rig.slack.calls
        if c.method == "chat.postMessage" and c.params.get("channel") == slack_channel
    ]
    assert [c.status for c in posts] == [429, 200]
    assert posts[1].timestamp - posts[0].timestamp >= 2.0
    delivery = await delivery_of(rig.db_url, run_id)
    assert (delivery.state, delivery.attempts) == ("sent", 2)
    assert len(rig.slack.posts(slack_channel)) == 1


async def test_a_refused_post_fails_the_delivery_at_once_with_slacks_error(
    rig: Rig, tmp_path: Path
) -> None:
    tenant = await rig.stack.tenant(scopes=(*apikeys.CLIENT_SCOPES, apikeys.RUNS_ALL))
    channel_id = await rig.add_channel(tenant, "slack")
    text = prompt("refused")
    rig.stack.model.script(text, [TextTurn("Nobody will see this.")])
    rig.slack.script("chat.postMessage", ApiError("channel_not_found"), times=1)
    run_id, slack_channel, _ = await rig.slack_run(tenant, channel_id, text)
    run = await wait_for_status(rig.db_url, run_id, "completed", "failed", timeout=30)
    assert run.status == "completed", "runtime completion is not the task outcome"
    delivery = await delivery_of(rig.db_url, run_id)
    assert (delivery.state, delivery.attempts) == ("failed", 1)
    assert "channel_not_found" in delivery.error["message"]
    posts = [
        c
        for c in rig.slack.calls
        if c.method == "chat.postMessage" and c.params.get("channel") == slack_channel
    ]
    assert len(posts) == 1, "a refusal is not retried"
    events = await events_of(rig.db_url, run_id)
    assert delivery_events(events) == ["delivery.failed", "run.completed"]
    failed = next(p for _, t, p in events if t == "delivery.failed")
    assert "channel_not_found" in failed["error"]["message"]
    shown = (await tether_json(rig, tenant.api_key, tmp_path, "run", run_id))["delivery"]
    assert shown["state"] == "failed"
    assert "channel_not_found" in shown["error"]["message"]


async def test_a_removed_connection_fails_the_delivery_saying_so(rig: Rig) -> None:
    tenant = await rig.stack.tenant()
    channel_id = await rig.add_channel(tenant, "slack")
    # Removed after its message was verified and before the answer goes out.
    await rig.remove_channel(tenant, channel_id)
    text = prompt("removed meanwhile")
    rig.stack.model.script(text, [TextTurn("Too late.")])
    run_id, slack_channel, _ = await rig.slack_run(tenant, channel_id, text)
    run = await wait_for_status(rig.db_url, run_id, "completed", "failed", timeout=30)
    assert run.status == "completed"
    delivery = await delivery_of(rig.db_url, run_id)
    assert (delivery.state, delivery.error["code"]) == ("failed", "channel_removed")
    assert "removed" in delivery.error["message"]
    assert rig.slack.posts(slack_channel) == []


async def test_the_sending_credentials_never_reach_a_log_line(rig: Rig) -> None:
    tenant = await rig.stack.tenant()
    slack_id = await rig.add_channel(tenant, "slack")
    whatsapp_id = await rig.add_channel(tenant, "whatsapp")
    text = prompt("token")
    rig.stack.model.script(text, [TextTurn("Logged nowhere.")])
    run_id, slack_channel, _ = await rig.slack_run(tenant, slack_id, text)
    await wait_for_status(rig.db_url, run_id, "completed", "failed", timeout=30)
    assert len(rig.slack.posts(slack_channel)) == 1
    text = prompt("token too")
    sender = f"1555{uuid.uuid4().int % 10**7:07d}"
    rig.stack.model.script(text, [TextTurn("Nor here.")])
    run_id = await rig.admit(
        tenant, whatsapp_id, "whatsapp", text, address=sender, thread="", reply_to=""
    )
    await wait_for_status(rig.db_url, run_id, "completed", "failed", timeout=30)
    assert len(rig.whatsapp.messages(sender)) == 1
    for name, proc in rig.stack.services.procs.items():
        logged = proc.log_path.read_text(errors="replace")
        assert rig.slack.bot_token not in logged, name
        assert rig.whatsapp.access_token not in logged, name


GATED = {"approvals": {"risks": {"send_reply": {"decisions": ["allow-once", "deny"]}}}}


async def decide(rig: Rig, key: str, run_id: str, decision: str) -> None:
    async with grpc.aio.insecure_channel(rig.stack.addr("gateway")) as channel:
        await gateway_pb2_grpc.GatewayServiceStub(channel).DecideApproval(
            gateway_pb2.DecideApprovalRequest(run_id=run_id, decision=decision),
            metadata=(("authorization", f"Bearer {key}"),),
        )


async def parked_draft(rig: Rig, text: str) -> tuple[Any, str, str, str, Any]:
    """A gated channel run parked with its draft: (tenant, run, channel, thread, delivery)."""
    tenant = await rig.stack.tenant(agent=GATED, scopes=(*apikeys.CLIENT_SCOPES, apikeys.RUNS_ALL))
    channel_id = await rig.add_channel(tenant, "slack")
    rig.stack.model.script(text, [TextTurn("The drafted answer."), TextTurn("A regenerated one.")])
    run_id, slack_channel, ts = await rig.slack_run(tenant, channel_id, text)
    await wait_for_status(rig.db_url, run_id, "waiting-for-approval", "completed", timeout=30)
    delivery = await delivery_of(rig.db_url, run_id)
    assert (delivery.state, delivery.text, delivery.attempts) == (
        "awaiting-approval",
        "The drafted answer.",
        0,
    )
    assert rig.slack.posts(slack_channel) == [], "nothing goes out before a person allows it"
    return tenant, run_id, slack_channel, ts, delivery


async def test_an_approval_gated_reply_sends_the_stored_draft_once_when_allowed(rig: Rig) -> None:
    tenant, run_id, slack_channel, ts, _ = await parked_draft(rig, prompt("gated allow"))
    await decide(rig, tenant.api_key, run_id, "allow-once")
    run = await wait_for_status(rig.db_url, run_id, "completed", "failed", timeout=30)
    assert run.status == "completed"
    replies = [m.text for m in rig.slack.thread(slack_channel, ts) if m.bot_id is not None]
    assert replies == ["The drafted answer."], "the stored draft, once, never a regenerated one"
    delivery = await delivery_of(rig.db_url, run_id)
    assert (delivery.state, delivery.attempts) == ("sent", 1)
    assert run.result_text == "The drafted answer."
    events = delivery_events(await events_of(rig.db_url, run_id))
    assert events == ["delivery.sent", "run.completed"]


async def test_an_approval_gated_reply_denied_is_never_posted(rig: Rig) -> None:
    tenant, run_id, slack_channel, _, _ = await parked_draft(rig, prompt("gated deny"))
    await decide(rig, tenant.api_key, run_id, "deny")
    run = await wait_for_status(rig.db_url, run_id, "completed", "failed", timeout=30)
    assert run.status == "completed"
    delivery = await delivery_of(rig.db_url, run_id)
    assert (delivery.state, delivery.attempts) == ("denied", 0)
    assert rig.slack.posts(slack_channel) == []
    assert delivery_events(await events_of(rig.db_url, run_id)) == [
        "delivery.denied",
        "run.completed",
    ]


async def test_a_whatsapp_reply_carries_its_delivery_as_callback_data(rig: Rig) -> None:
    tenant = await rig.stack.tenant()
    channel_id = await rig.add_channel(tenant, "whatsapp")
    text = prompt("hello from whatsapp")
    sender = f"1555{uuid.uuid4().int % 10**7:07d}"
    rig.stack.model.script(text, [TextTurn("WhatsApp answer.")])
    run_id = await rig.admit(
        tenant, channel_id, "whatsapp", text, address=sender, thread="", reply_to="wamid.IN1"
    )
    run = await wait_for_status(rig.db_url, run_id, "completed", "failed", timeout=30)
    assert run.status == "completed"
    (message,) = rig.whatsapp.messages(sender)
    delivery = await delivery_of(rig.db_url, run_id)
    assert (message.text, message.context_message_id) == ("WhatsApp answer.", "wamid.IN1")
    assert message.biz_opaque_callback_data == delivery.delivery_id
    assert (delivery.state, delivery.provider_message_id) == ("sent", message.id)


async def test_a_whatsapp_reply_sent_before_a_crash_is_reconciled_by_its_status(rig: Rig) -> None:
    tenant = await rig.stack.tenant()
    channel_id = await rig.add_channel(tenant, "whatsapp")
    text = prompt("whatsapp kill")
    sender = f"1555{uuid.uuid4().int % 10**7:07d}"
    rig.stack.model.script(text, [TextTurn("Sent once."), TextTurn("A second draft.")])
    rig.whatsapp.hold_answers()
    run_id = await rig.admit(
        tenant, channel_id, "whatsapp", text, address=sender, thread="", reply_to="wamid.IN2"
    )
    async with asyncio.timeout(30):
        await rig.whatsapp.wait_until(lambda server: bool(server.messages(sender)))
    worker = worker_of(rig)
    rig.stack.services.kill(worker)
    rig.whatsapp.release_answers()
    (message,) = rig.whatsapp.messages(sender)
    # The status callback as the gateway's webhook records it (its stand-in's body: "sent").
    await record_status(
        rig, tenant.tenant_id, channel_id, message.id, message.biz_opaque_callback_data
    )
    await rig.stack.services.restart(worker)
    run = await wait_for_status(rig.db_url, run_id, "completed", "failed", timeout=60)
    assert (run.status, run.attempt) == ("completed", 2)
    assert [m.text for m in rig.whatsapp.messages(sender)] == ["Sent once."]
    delivery = await delivery_of(rig.db_url, run_id)
    assert (delivery.state, delivery.provider_message_id) == ("sent", message.id)


async def record_status(
    rig: Rig, tenant_id: str, channel_id: str, message_id: str, callback_data: str | None
) -> None:
    engine = create_engine(rig.db_url, pool_size=1)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                insert(channel_statuses).values(
                    tenant_id=tenant_id,
                    channel_id=channel_id,
                    provider_message_id=message_id,
                    status="sent",
                    callback_data=callback_data,
                    reported_at=datetime.now(UTC),
                )
            )
    finally:
        await engine.dispose()


async def test_a_generic_reply_is_signed_with_its_delivery_as_webhook_id(rig: Rig) -> None:
    secret = "whsec_" + base64.b64encode(os.urandom(24)).decode()
    receiver = Receiver(secret)
    receiver.fail_first = 1
    await receiver.start()
    try:
        tenant = await rig.stack.tenant()
        channel_id = await rig.add_webhook_channel(tenant, secret, receiver.base_url + "/reply")
        text = prompt("generic")
        rig.stack.model.script(text, [TextTurn("Signed answer.")])
        run_id = await rig.admit(
            tenant,
            channel_id,
            "webhook",
            text,
            address="thread-9",
            thread="thread-9",
            reply_to="m1",
        )
        run = await wait_for_status(rig.db_url, run_id, "completed", "failed", timeout=30)
        assert run.status == "completed"
        delivery = await delivery_of(rig.db_url, run_id)
        assert (delivery.state, delivery.attempts) == ("sent", 2)
        assert receiver.refused == [], "every POST verified"
        # The 503 and the retry carry the same webhook-id: the receiver deduplicates on it.
        assert [webhook_id for webhook_id, _ in receiver.received] == [delivery.delivery_id] * 2
        answered = receiver.received[-1][1]
        assert (answered["text"], answered["thread"], answered["reply_to"]) == (
            "Signed answer.",
            "thread-9",
            "m1",
        )
    finally:
        await receiver.stop()


async def test_only_a_live_lease_of_the_connections_run_gets_its_sending_credential(
    rig: Rig,
) -> None:
    tenant = await rig.stack.tenant()
    channel_id = await rig.add_channel(tenant, "slack")
    text = prompt("credential")
    rig.stack.model.script(text, [TextTurn("Done.")])
    run_id, _, _ = await rig.slack_run(tenant, channel_id, text)
    run = await wait_for_status(rig.db_url, run_id, "completed", "failed", timeout=30)
    request = ipb.LookupChannelDeliveryRequest(
        run_id=run_id, epoch=run.lease_epoch, channel_id=channel_id
    )
    address = rig.stack.addr("interactions")
    async with internal_channel(address, rig.stack.credentials["worker"]) as channel:
        stub = interactions_pb2_grpc.InteractionsServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as stale:
            await stub.LookupChannelDelivery(request)
    assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION, "the run's lease is over"
    async with internal_channel(address, rig.stack.credentials["gateway"]) as channel:
        stub = interactions_pb2_grpc.InteractionsServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.LookupChannelDelivery(request)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, "the worker's alone"
    assert rig.slack.bot_token not in (stale.value.details() or "")


async def test_a_run_cancelled_while_its_answer_waits_to_go_out_leaves_no_delivery_open(
    rig: Rig,
) -> None:
    tenant = await rig.stack.tenant(scopes=(*apikeys.CLIENT_SCOPES, apikeys.RUNS_ALL))
    channel_id = await rig.add_channel(tenant, "slack")
    text = prompt("cancelled mid-delivery")
    rig.stack.model.script(text, [TextTurn("Never mind.")])
    rig.slack.script("chat.postMessage", RateLimited(retry_after=30), times=1)
    run_id, slack_channel, _ = await rig.slack_run(tenant, channel_id, text)
    async with asyncio.timeout(30):
        await rig.slack.wait_until(
            lambda calls: any(
                c.method == "chat.postMessage"
                and c.status == 429
                and c.params.get("channel") == slack_channel
                for c in calls
            )
        )
    await tenant.cancel(run_id)
    run = await wait_for_status(rig.db_url, run_id, "cancelled", "completed", "failed", timeout=15)
    assert run.status == "cancelled"
    delivery = await delivery_of(rig.db_url, run_id)
    assert delivery.state == "unknown", "a counted call: never sent again to find out"
    assert "cancelled" in delivery.error["message"]
    assert rig.slack.posts(slack_channel) == []
    types = [t for _, t, _ in await events_of(rig.db_url, run_id)]
    assert types.index("delivery.unknown") < types.index("run.cancelled")
