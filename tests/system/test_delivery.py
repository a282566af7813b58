"""A channel run's answer goes back out through its channel, once (issue 30, stage 3), with the
services as real processes and the Slack and WhatsApp stand-ins as the providers: one threaded
reply carrying its delivery id in the message metadata, recorded before it is sent, reported by
`delivery.*` before `run.completed`; never twice, even when the worker is SIGKILLed after the
provider stored the post and before its answer came back; `unknown` rather than a second post
when the provider cannot be asked; Retry-After honoured; a refusal kept; the answer gated by the
agent's approvals; WhatsApp reconciled through its status callback."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.system.delivery_support import Rig, delivery_of, delivery_rig
from tests.system.execution_support import events_of, wait_for_status
from tether.testing.model_server import TextTurn
from tether.testing.slack_server import ApiError, HttpFailure, RateLimited

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


async def test_a_slack_run_gets_one_threaded_reply_carrying_its_delivery(rig: Rig) -> None:
    tenant = await rig.stack.tenant()
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


async def test_a_worker_killed_after_slack_stored_the_post_never_posts_twice(rig: Rig) -> None:
    tenant = await rig.stack.tenant()
    channel_id = await rig.add_channel(tenant, "slack")
    text = prompt("kill me mid-post")
    rig.stack.model.script(text, [TextTurn("The one answer."), TextTurn("A second draft.")])
    rig.slack.hold_post_answers()
    run_id, slack_channel, ts = await rig.slack_run(tenant, channel_id, text)

    def held(calls: Any) -> bool:
        return any(c.method == "chat.postMessage" and c.outcome == "held" for c in calls)

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
            lambda calls: any(c.method == "chat.postMessage" and c.outcome == "held" for c in calls)
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


async def test_a_refused_post_fails_the_delivery_at_once_with_slacks_error(rig: Rig) -> None:
    tenant = await rig.stack.tenant()
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


async def test_the_bot_token_never_reaches_a_log_line(rig: Rig) -> None:
    tenant = await rig.stack.tenant()
    channel_id = await rig.add_channel(tenant, "slack")
    text = prompt("token")
    rig.stack.model.script(text, [TextTurn("Logged nowhere.")])
    run_id, slack_channel, _ = await rig.slack_run(tenant, channel_id, text)
    await wait_for_status(rig.db_url, run_id, "completed", "failed", timeout=30)
    assert len(rig.slack.posts(slack_channel)) == 1
    token = rig.slack.bot_token
    for name, proc in rig.stack.services.procs.items():
        assert token not in proc.log_path.read_text(errors="replace"), name
