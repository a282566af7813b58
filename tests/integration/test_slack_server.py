"""The local Slack stand-in spoken to by the real `slack-sdk` (AsyncWebClient over loopback), and
the stand-in's signed events checked by slack-sdk's own `SignatureVerifier`."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from slack_sdk.errors import SlackApiError
from slack_sdk.http_retry.builtin_async_handlers import AsyncRateLimitErrorRetryHandler
from slack_sdk.signature import Clock, SignatureVerifier
from slack_sdk.web.async_client import AsyncWebClient

import tether.testing.slack_server as slack_module
from tether.testing.slack_events import (
    deliver,
    encode,
    message_event,
    sign,
    url_verification,
)
from tether.testing.slack_server import (
    ApiError,
    HttpFailure,
    RateLimited,
    SlackServer,
)

LIBS_DIR = Path(slack_module.__file__).resolve().parents[2]
SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
DELIVERY_METADATA = {"event_type": "tether_delivery", "event_payload": {"delivery_id": "dlv_1"}}


@pytest.fixture
async def slack() -> AsyncIterator[SlackServer]:
    async with SlackServer() as running:
        yield running


def client_for(slack: SlackServer, token: str | None = None, **options: Any) -> AsyncWebClient:
    return AsyncWebClient(
        token=slack.bot_token if token is None else token, base_url=slack.api_url, **options
    )


async def test_a_threaded_post_is_read_back_with_its_metadata(slack: SlackServer) -> None:
    event = slack.user_message("C1", "U1", "where is my order?")
    parent = event["event"]["ts"]
    client = client_for(slack)

    posted = await client.chat_postMessage(
        channel="C1", text="on its way", thread_ts=parent, metadata=DELIVERY_METADATA
    )
    assert posted["ok"] is True
    assert posted["channel"] == "C1"
    assert posted["ts"] > parent
    assert slack.calls[0].token == slack.bot_token  # sent as Authorization: Bearer

    with_metadata = await client.conversations_replies(
        channel="C1", ts=parent, include_all_metadata=True
    )
    messages = with_metadata["messages"]
    assert [(m["ts"], m["text"]) for m in messages] == [
        (parent, "where is my order?"),
        (posted["ts"], "on its way"),
    ]
    assert messages[1]["thread_ts"] == parent
    assert messages[1]["metadata"] == DELIVERY_METADATA
    assert "metadata" not in messages[0]

    without = await client.conversations_replies(channel="C1", ts=parent)
    assert all("metadata" not in m for m in without["messages"])
    assert [m.text for m in slack.posts("C1")] == ["on its way"]


async def test_a_form_post_carries_its_token_and_metadata_as_fields(slack: SlackServer) -> None:
    parent = slack.user_message("C1", "U1", "hi")["event"]["ts"]
    form = {
        "token": slack.bot_token,
        "channel": "C1",
        "text": "hello",
        "thread_ts": parent,
        "metadata": json.dumps(DELIVERY_METADATA),
    }
    async with (
        aiohttp.ClientSession() as session,
        session.post(slack.api_url + "chat.postMessage", data=form) as response,
    ):
        assert response.status == 200
        answer = await response.json()
    assert answer["ok"] is True
    assert slack.thread("C1", parent)[1].metadata == DELIVERY_METADATA


async def test_replies_page_with_a_cursor(slack: SlackServer) -> None:
    parent = slack.user_message("C1", "U1", "count")["event"]["ts"]
    client = client_for(slack)
    for number in range(4):
        await client.chat_postMessage(channel="C1", text=str(number), thread_ts=parent)
    first = await client.conversations_replies(channel="C1", ts=parent, limit=3)
    assert first["has_more"] is True
    cursor = first["response_metadata"]["next_cursor"]
    second = await client.conversations_replies(channel="C1", ts=parent, limit=3, cursor=cursor)
    assert second["has_more"] is False
    texts = [m["text"] for m in first["messages"] + second["messages"]]
    assert texts == ["count", "0", "1", "2", "3"]


async def test_replies_named_by_a_reply_list_the_whole_thread(slack: SlackServer) -> None:
    parent = slack.user_message("C1", "U1", "question")["event"]["ts"]
    slack.user_message("C1", "U2", "elsewhere")
    client = client_for(slack)
    reply = await client.chat_postMessage(channel="C1", text="answer", thread_ts=parent)
    listed = await client.conversations_replies(channel="C1", ts=reply["ts"])
    assert [m["text"] for m in listed["messages"]] == ["question", "answer"]


async def test_refusals_are_ok_false_with_http_200_and_store_nothing(slack: SlackServer) -> None:
    for token, error in (("xoxb-wrong", "invalid_auth"), ("", "not_authed")):
        with pytest.raises(SlackApiError) as refused:
            await client_for(slack, token).chat_postMessage(channel="C1", text="x")
        assert refused.value.response.status_code == 200
        assert refused.value.response["error"] == error

    client = client_for(slack)
    bad = {"event_type": "tether_delivery", "event_payload": "not an object"}
    with pytest.raises(SlackApiError) as refused:
        await client.chat_postMessage(channel="C1", text="x", metadata=bad)
    assert refused.value.response["error"] == "invalid_metadata_schema"
    with pytest.raises(SlackApiError) as refused:
        await client.conversations_replies(channel="C1", ts="1.000001")
    assert refused.value.response["error"] == "channel_not_found"
    assert slack.messages("C1") == []
    assert (await client.auth_test())["bot_id"] == "B0TETHERBOT"


async def test_a_rate_limit_reaches_the_client_with_retry_after(slack: SlackServer) -> None:
    slack.script("chat.postMessage", RateLimited(retry_after=3), times=1)
    with pytest.raises(SlackApiError) as limited:
        await client_for(slack, retry_handlers=[]).chat_postMessage(channel="C1", text="x")
    assert limited.value.response.status_code == 429
    assert limited.value.response.headers["Retry-After"] == "3"
    assert limited.value.response["error"] == "ratelimited"
    assert slack.messages("C1") == []
    # Only the scripted call was limited: the next one is stored.
    await client_for(slack, retry_handlers=[]).chat_postMessage(channel="C1", text="x")
    assert [m.text for m in slack.messages("C1")] == ["x"]


async def test_the_sdks_rate_limit_handler_waits_at_least_retry_after(slack: SlackServer) -> None:
    slack.script("chat.postMessage", RateLimited(retry_after=1), times=1)
    client = client_for(slack, retry_handlers=[AsyncRateLimitErrorRetryHandler(max_retry_count=1)])
    started = time.monotonic()
    posted = await client.chat_postMessage(channel="C1", text="once")
    waited = time.monotonic() - started
    assert posted["ok"] is True
    assert waited >= 1.0
    assert [c.status for c in slack.calls] == [429, 200]
    assert [m.text for m in slack.messages("C1")] == ["once"]


async def test_replies_that_cannot_be_asked(slack: SlackServer) -> None:
    parent = slack.user_message("C1", "U1", "hi")["event"]["ts"]
    client = client_for(slack, retry_handlers=[])
    slack.script("conversations.replies", HttpFailure(503), times=None)
    for _ in range(2):  # until cleared, not once
        with pytest.raises(SlackApiError) as unavailable:
            await client.conversations_replies(channel="C1", ts=parent)
        assert unavailable.value.response.status_code == 503
    slack.clear_script("conversations.replies")
    slack.script("conversations.replies", ApiError("fatal_error"))
    with pytest.raises(SlackApiError) as failed:
        await client.conversations_replies(channel="C1", ts=parent)
    assert failed.value.response["error"] == "fatal_error"
    assert (await client.conversations_replies(channel="C1", ts=parent))["ok"] is True


async def test_a_held_answer_arrives_after_release_with_the_stored_post(slack: SlackServer) -> None:
    parent = slack.user_message("C1", "U1", "hi")["event"]["ts"]
    slack.hold_post_answers()
    client = client_for(slack)
    post = asyncio.create_task(client.chat_postMessage(channel="C1", text="held", thread_ts=parent))
    async with asyncio.timeout(10):
        await slack.wait_until(lambda log: any(c.outcome == "held" for c in log))
    stored = slack.posts("C1")
    assert [m.text for m in stored] == ["held"]
    assert not post.done()

    slack.release_post_answers()
    async with asyncio.timeout(10):
        answer = await post
    assert answer["ts"] == stored[0].ts
    assert slack.calls[-1].outcome == "answered"


async def test_a_caller_gone_while_held_leaves_the_post_stored(slack: SlackServer) -> None:
    slack.hold_post_answers()
    post = asyncio.create_task(client_for(slack).chat_postMessage(channel="C1", text="lost"))
    async with asyncio.timeout(10):
        await slack.wait_until(lambda log: any(c.outcome == "held" for c in log))
    post.cancel()  # closes the connection, as a killed caller's kernel would
    async with asyncio.timeout(10):
        await slack.wait_until(lambda log: log[-1].outcome == "disconnected")
    assert [m.text for m in slack.posts("C1")] == ["lost"]


async def test_a_held_answer_is_never_sent_when_the_stand_in_stops(slack: SlackServer) -> None:
    slack.hold_post_answers()
    post = asyncio.create_task(client_for(slack).chat_postMessage(channel="C1", text="kept"))
    async with asyncio.timeout(10):
        await slack.wait_until(lambda log: any(c.outcome == "held" for c in log))
    await slack.stop()
    with pytest.raises(aiohttp.ClientError):
        await post
    assert slack.calls[-1].outcome == "server_stopped"
    assert [m.text for m in slack.posts("C1")] == ["kept"]


def test_slack_sdks_verifier_accepts_what_the_stand_in_signs_and_nothing_else() -> None:
    body = encode(message_event(channel="C1", user="U1", text="hi", ts="1700000000.000100"))
    verifier = SignatureVerifier(SECRET)
    assert verifier.is_valid_request(body, sign(body, SECRET))

    forged = sign(body, "another-secret")
    assert not verifier.is_valid_request(body, forged)
    assert not verifier.is_valid_request(body + b" ", sign(body, SECRET))

    stamp = int(time.time()) - 301  # Slack's window is five minutes
    stale = sign(body, SECRET, timestamp=stamp)
    assert not verifier.is_valid_request(body, stale)

    class Then(Clock):
        def now(self) -> float:
            return float(stamp)

    # The stale signature is otherwise right: only its age is refused.
    assert SignatureVerifier(SECRET, Then()).is_valid_request(body, stale)


async def test_delivered_events_are_signed_and_carry_slacks_retry_headers() -> None:
    verifier = SignatureVerifier(SECRET)
    seen: list[tuple[bool, dict[str, Any], dict[str, str]]] = []

    async def receive(request: web.Request) -> web.Response:
        raw = await request.read()
        valid = verifier.is_valid_request(raw, dict(request.headers))
        body = json.loads(raw)
        seen.append((valid, body, dict(request.headers)))
        if not valid:
            return web.json_response({"error": "bad signature"}, status=401)
        if body["type"] == "url_verification":
            return web.json_response({"challenge": body["challenge"]})
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/events", receive)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/events"
    try:
        challenge = url_verification("ch-123")
        answered = await deliver(url, challenge, SECRET)
        assert (answered.status, answered.json()) == (200, {"challenge": "ch-123"})

        event = message_event(channel="C1", user="U1", text="hi", ts="1.000001", thread_ts="1.0")
        retried = await deliver(url, event, SECRET, retry_num=1, retry_reason="http_timeout")
        assert retried.status == 200
        _, body, headers = seen[-1]
        assert body["event_id"] == event["event_id"]
        assert body["event"]["thread_ts"] == "1.0"
        assert (headers["X-Slack-Retry-Num"], headers["X-Slack-Retry-Reason"]) == (
            "1",
            "http_timeout",
        )

        forged = await deliver(url, event, SECRET, headers={"X-Slack-Signature": "v0=" + "0" * 64})
        assert forged.status == 401
    finally:
        await runner.cleanup()
    assert [valid for valid, _, _ in seen] == [True, True, False]


async def test_the_cli_serves_in_a_separate_process() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(LIBS_DIR), env.get("PYTHONPATH")]))
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tether.testing.slack_server",
        "--port",
        "0",
        "--bot-token",
        "xoxb-cli",
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        assert process.stdout is not None
        async with asyncio.timeout(30):
            line = (await process.stdout.readline()).decode()
        announced = re.fullmatch(r"slack listening (http://127\.0\.0\.1:\d+)\n", line)
        assert announced, line
        base = announced.group(1)
        client = AsyncWebClient(token="xoxb-cli", base_url=base + "/api/", retry_handlers=[])
        async with aiohttp.ClientSession(base) as control:
            async with control.post(
                "/_user_message", json={"channel": "C9", "user": "U1", "text": "q"}
            ) as r:
                parent = (await r.json())["event"]["ts"]
            script = {
                "method": "chat.postMessage",
                "fault": {"kind": "rate_limited", "retry_after": 2},
            }
            async with control.post("/_script", json=script) as r:
                assert r.status == 200
            async with control.post("/_hold", data=b"not json") as r:
                assert r.status == 400
            with pytest.raises(SlackApiError):
                await client.chat_postMessage(channel="C9", text="a", thread_ts=parent)
            await client.chat_postMessage(channel="C9", text="a", thread_ts=parent)
            async with control.get("/_messages", params={"channel": "C9"}) as r:
                stored = (await r.json())["messages"]
            async with control.get("/_requests") as r:
                statuses = [c["status"] for c in (await r.json())["requests"]]
        assert [(m["text"], m["thread_ts"]) for m in stored] == [("q", None), ("a", parent)]
        assert statuses == [429, 200]
    finally:
        if process.returncode is None:
            process.terminate()
        await process.communicate()
    assert process.returncode == 0
