"""The Slack stand-in delivering a person's message to the app's Request URL: stored, POSTed
signed as Slack signs (checked by slack-sdk's `SignatureVerifier.is_valid` on what an in-process
receiver got), answered with the receiver's status; set in process, by `POST /_webhook` and by
the command line's `--webhook-url`/`--signing-secret`."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from slack_sdk.signature import SignatureVerifier

import tether.testing.slack_server as slack_module
from tether.testing.slack_server import SlackServer
from tether.testing.slack_wire import DEMO_SIGNING_SECRET

LIBS_DIR = Path(slack_module.__file__).resolve().parents[2]
SECRET = "8f742231b10e8888abcd99yyyzzz85a5"


@dataclass
class Receiver:
    """An app's Request URL in process: what it got (raw body, headers) and what it answers."""

    url: str = ""
    status: int = 200
    got: list[tuple[bytes, dict[str, str]]] = field(default_factory=list)

    async def receive(self, request: web.Request) -> web.Response:
        self.got.append((await request.read(), dict(request.headers)))
        return web.json_response({}, status=self.status)

    def valid(self, secret: str, index: int = -1) -> bool:
        """slack-sdk's own check of delivery `index` under `secret`."""
        raw, headers = self.got[index]
        return SignatureVerifier(secret).is_valid(
            body=raw,
            timestamp=headers["X-Slack-Request-Timestamp"],
            signature=headers["X-Slack-Signature"],
        )


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    found = Receiver()
    app = web.Application()
    app.router.add_post("/v2/webhooks/slack/ch_1", found.receive)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    found.url = f"http://127.0.0.1:{runner.addresses[0][1]}/v2/webhooks/slack/ch_1"
    try:
        yield found
    finally:
        await runner.cleanup()


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_a_user_message_is_stored_and_delivered_signed_as_slack_signs(
    receiver: Receiver,
) -> None:
    async with SlackServer(webhook_url=receiver.url, signing_secret=SECRET) as slack:
        body, pushed = await slack.send_user_message("C1", "U1", "where is my parcel?")
    assert pushed is not None and pushed.status == 200
    assert [(m.user, m.text) for m in slack.messages("C1")] == [("U1", "where is my parcel?")]
    ((raw, headers),) = receiver.got
    assert json.loads(raw) == body, "the event_callback, byte for byte what was signed"
    assert body["type"] == "event_callback" and body["event"]["text"] == "where is my parcel?"
    assert headers["Content-Type"] == "application/json"
    assert receiver.valid(SECRET)
    assert not receiver.valid("another-secret"), "signed with the secret given, no other"
    tampered = SignatureVerifier(SECRET).is_valid(
        body=raw + b" ",
        timestamp=headers["X-Slack-Request-Timestamp"],
        signature=headers["X-Slack-Signature"],
    )
    assert not tampered


async def test_without_a_webhook_nothing_is_delivered(receiver: Receiver) -> None:
    async with SlackServer() as slack:
        body, pushed = await slack.send_user_message("C1", "U1", "hi")
        assert pushed is None and body["event"]["text"] == "hi"
        slack.set_webhook(receiver.url)
        _, pushed = await slack.send_user_message("C1", "U1", "again")
    assert pushed is not None and pushed.status == 200
    assert len(receiver.got) == 1
    assert receiver.valid(DEMO_SIGNING_SECRET), "the demo signing secret unless told another"


async def test_the_control_api_sets_the_webhook_and_answers_with_its_status(
    receiver: Receiver,
) -> None:
    async with SlackServer() as slack, aiohttp.ClientSession(slack.base_url) as control:
        for wrong in ({"url": "ftp://x"}, {"url": receiver.url}, {"signing_secret": SECRET}):
            async with control.post("/_webhook", json=wrong) as r:
                assert r.status == 400, wrong
        async with control.post("/_webhook", data=b"not json") as r:
            assert r.status == 400
        async with control.get("/_webhook") as r:
            assert await r.json() == {"url": None}
        webhook = {"url": receiver.url, "signing_secret": SECRET}
        async with control.post("/_webhook", json=webhook) as r:
            assert r.status == 200
        async with control.get("/_webhook") as r:
            assert await r.json() == {"url": receiver.url}, "the URL, never the secret"

        message = {"channel": "C7", "user": "U2", "text": "hello"}
        async with control.post("/_user_message", json=message) as r:
            assert r.status == 200
            answered = await r.json()
        assert json.loads(receiver.got[-1][0]) == answered
        assert receiver.valid(SECRET)

        receiver.status = 401  # the app refuses it: the person's side hears so
        async with control.post("/_user_message", json={**message, "text": "again"}) as r:
            assert r.status == 401
        assert len(receiver.got) == 2

        unreachable = {"url": f"http://127.0.0.1:{closed_port()}/x", "signing_secret": SECRET}
        async with control.post("/_webhook", json=unreachable) as r:
            assert r.status == 200
        async with control.post("/_user_message", json={**message, "text": "lost"}) as r:
            assert r.status == 502
            assert "not reached" in (await r.json())["error"]

        async with control.post("/_webhook", json={"url": None}) as r:
            assert r.status == 200
        async with control.post("/_user_message", json={**message, "text": "kept"}) as r:
            assert r.status == 200
        async with control.get("/_messages", params={"channel": "C7"}) as r:
            stored = [m["text"] for m in (await r.json())["messages"]]
    assert stored == ["hello", "again", "lost", "kept"], "every message is stored either way"
    assert len(receiver.got) == 2


async def test_the_command_line_takes_the_webhook_and_its_signing_secret(
    receiver: Receiver,
) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(LIBS_DIR), env.get("PYTHONPATH")]))
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "tether.testing.slack_server", "--port", "0"),
        *("--webhook-url", receiver.url, "--signing-secret", SECRET),
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        assert process.stdout is not None
        async with asyncio.timeout(30):
            line = (await process.stdout.readline()).decode()
        announced = re.fullmatch(r"slack listening (http://127\.0\.0\.1:\d+)\n", line)
        assert announced, line
        async with aiohttp.ClientSession(announced.group(1)) as control:
            message = {"channel": "C1", "user": "U1", "text": "hi"}
            async with control.post("/_user_message", json=message) as r:
                assert r.status == 200
                answered: dict[str, Any] = await r.json()
    finally:
        if process.returncode is None:
            process.terminate()
        await process.communicate()
    assert json.loads(receiver.got[-1][0]) == answered
    assert receiver.valid(SECRET)
