"""The local WhatsApp Cloud API stand-in spoken to over loopback by aiohttp, its status
callbacks received by a small aiohttp app that checks `X-Hub-Signature-256` with its own code."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import re
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

import tether.testing.whatsapp_server as whatsapp_module
from tether.testing.eventually import eventually
from tether.testing.whatsapp_events import deliver, encode, handshake, sign, text_message
from tether.testing.whatsapp_server import (
    GraphError,
    HttpFailure,
    RateLimited,
    StatusPlan,
    WhatsAppServer,
)

LIBS_DIR = Path(whatsapp_module.__file__).resolve().parents[2]
APP_SECRET = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"
VERIFY_TOKEN = "verify-me"
CUSTOMER = "15551234567"


def verified(app_secret: str, raw: bytes, header: str | None) -> bool:
    """Meta's scheme written a second time, here, for the receiver."""
    expected = "sha256=" + hmac.new(app_secret.encode(), raw, hashlib.sha256).hexdigest()
    return header is not None and hmac.compare_digest(expected, header)


@dataclass
class Receiver:
    """A webhook endpoint: the handshake, and POSTs kept with whether their signature held."""

    url: str = ""
    posts: list[tuple[bool, dict[str, Any]]] = field(default_factory=list)

    def statuses(self) -> list[dict[str, Any]]:
        return [
            status
            for valid, body in self.posts
            if valid
            for entry in body["entry"]
            for change in entry["changes"]
            for status in change["value"].get("statuses", [])
        ]

    async def receive(self, request: web.Request) -> web.Response:
        raw = await request.read()
        valid = verified(APP_SECRET, raw, request.headers.get("X-Hub-Signature-256"))
        self.posts.append((valid, json.loads(raw)))
        if not valid:
            return web.json_response({"error": "bad signature"}, status=401)
        return web.json_response({})

    async def subscribe(self, request: web.Request) -> web.Response:
        query = request.query
        if query.get("hub.mode") == "subscribe" and query.get("hub.verify_token") == VERIFY_TOKEN:
            return web.Response(text=query["hub.challenge"])
        return web.Response(status=403)


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    received = Receiver()
    app = web.Application()
    app.router.add_post("/webhook", received.receive)
    app.router.add_get("/webhook", received.subscribe)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    received.url = f"http://127.0.0.1:{runner.addresses[0][1]}/webhook"
    try:
        yield received
    finally:
        await runner.cleanup()


@pytest.fixture
async def whatsapp(receiver: Receiver) -> AsyncIterator[WhatsAppServer]:
    async with WhatsAppServer(app_secret=APP_SECRET, webhook_url=receiver.url) as running:
        yield running


def outbound(text: str, **extra: Any) -> dict[str, Any]:
    return {
        "messaging_product": "whatsapp",
        "recipient_type": "individual",
        "to": CUSTOMER,
        "type": "text",
        "text": {"body": text},
        **extra,
    }


async def send(
    whatsapp: WhatsAppServer, body: Any, token: str | None = None
) -> tuple[int, dict[str, str], dict[str, Any]]:
    headers = {"Authorization": f"Bearer {whatsapp.access_token if token is None else token}"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(whatsapp.messages_url, json=body, headers=headers) as response,
    ):
        return response.status, dict(response.headers), await response.json()


async def test_a_send_is_answered_with_a_wamid_and_stored(whatsapp: WhatsAppServer) -> None:
    body = outbound("on its way", context={"message_id": "wamid.question"})
    status, _, answer = await send(whatsapp, body)
    assert status == 200
    wamid = answer["messages"][0]["id"]
    assert wamid.startswith("wamid.")
    assert answer["messaging_product"] == "whatsapp"
    assert answer["contacts"] == [{"input": CUSTOMER, "wa_id": CUSTOMER}]
    stored = whatsapp.messages(CUSTOMER)
    assert [(m.id, m.text, m.context_message_id) for m in stored] == [
        (wamid, "on its way", "wamid.question")
    ]
    assert whatsapp.calls[0].token == whatsapp.access_token
    second = (await send(whatsapp, outbound("again")))[2]["messages"][0]["id"]
    assert second != wamid


async def test_refusals_are_graph_errors_and_store_nothing(whatsapp: WhatsAppServer) -> None:
    status, _, answer = await send(whatsapp, outbound("x"), token="EAA-wrong")
    assert status == 401
    assert answer["error"]["code"] == 190
    assert answer["error"]["type"] == "OAuthException"
    assert answer["error"]["fbtrace_id"]

    for invalid in (
        {**outbound("x"), "messaging_product": "sms"},
        {**outbound("x"), "text": {"body": ""}},
        {**outbound("x"), "to": None},
        outbound("x" * 4097),
        ["not", "an", "object"],
    ):
        status, _, answer = await send(whatsapp, invalid)
        assert (status, answer["error"]["code"]) == (400, 100), invalid
    assert whatsapp.messages() == []


async def test_a_rate_limit_answers_429_with_retry_after_then_accepts(
    whatsapp: WhatsAppServer,
) -> None:
    whatsapp.script(RateLimited(retry_after=2), times=1)
    whatsapp.script(RateLimited(code=131056), times=1)
    status, headers, answer = await send(whatsapp, outbound("x"))
    assert (status, headers["Retry-After"], answer["error"]["code"]) == (429, "2", 130429)
    status, headers, answer = await send(whatsapp, outbound("x"))
    assert (status, answer["error"]["code"]) == (429, 131056)
    assert "Retry-After" not in headers
    assert whatsapp.messages() == []
    assert (await send(whatsapp, outbound("x")))[0] == 200
    assert [c.status for c in whatsapp.calls] == [429, 429, 200]


async def test_scripted_outages_and_errors_until_cleared(whatsapp: WhatsAppServer) -> None:
    whatsapp.script(HttpFailure(503), times=None)
    for _ in range(2):
        async with (
            aiohttp.ClientSession() as session,
            session.post(whatsapp.messages_url, json=outbound("x")) as response,
        ):
            # The token is checked before the outage: this one has none.
            assert response.status == 401
        headers = {"Authorization": f"Bearer {whatsapp.access_token}"}
        async with (
            aiohttp.ClientSession() as session,
            session.post(whatsapp.messages_url, json=outbound("x"), headers=headers) as response,
        ):
            assert response.status == 503
    whatsapp.clear_script()
    whatsapp.script(GraphError(400, 131026, "Message undeliverable"))
    status, _, answer = await send(whatsapp, outbound("x"))
    assert (status, answer["error"]["code"], answer["error"]["message"]) == (
        400,
        131026,
        "Message undeliverable",
    )
    assert whatsapp.messages() == []


async def test_signed_status_callbacks_carry_the_opaque_data(
    whatsapp: WhatsAppServer, receiver: Receiver
) -> None:
    body = outbound("answer", biz_opaque_callback_data="delivery:dlv_1")
    wamid = (await send(whatsapp, body))[2]["messages"][0]["id"]
    async with asyncio.timeout(10):
        await whatsapp.wait_until(lambda s: len(s.callbacks) == 2 and s.callbacks[1].answered)
    assert [valid for valid, _ in receiver.posts] == [True, True]
    statuses = receiver.statuses()
    assert [(s["id"], s["status"]) for s in statuses] == [(wamid, "sent"), (wamid, "delivered")]
    assert {s["biz_opaque_callback_data"] for s in statuses} == {"delivery:dlv_1"}
    assert {s["recipient_id"] for s in statuses} == {CUSTOMER}
    _, first = receiver.posts[0]
    assert first["object"] == "whatsapp_business_account"
    value = first["entry"][0]["changes"][0]["value"]
    assert value["metadata"]["phone_number_id"] == whatsapp.phone_number_id
    assert [c.answered for c in whatsapp.callbacks] == [200, 200]


async def test_a_callback_signed_with_another_secret_is_refused_by_the_receiver(
    receiver: Receiver,
) -> None:
    async with WhatsAppServer(app_secret="not-the-apps", webhook_url=receiver.url) as whatsapp:
        await send(whatsapp, outbound("answer"))
        async with asyncio.timeout(10):
            await whatsapp.wait_until(lambda s: [c.answered for c in s.callbacks] == [401, 401])
    assert [valid for valid, _ in receiver.posts] == [False, False]


async def test_dropped_and_delayed_status_callbacks(
    whatsapp: WhatsAppServer, receiver: Receiver
) -> None:
    whatsapp.script_statuses(StatusPlan(drop=True), times=1)
    whatsapp.script_statuses(StatusPlan(delay_s=0.5), times=1)
    dropped = (await send(whatsapp, outbound("lost", biz_opaque_callback_data="a")))[2]
    delayed = (await send(whatsapp, outbound("late", biz_opaque_callback_data="b")))[2]
    assert not whatsapp.callbacks  # the delayed one waits its half second
    async with asyncio.timeout(10):
        await whatsapp.wait_until(lambda s: len(s.callbacks) == 2 and s.callbacks[1].answered)
    reported = {s["id"] for s in receiver.statuses()}
    assert reported == {delayed["messages"][0]["id"]}
    assert dropped["messages"][0]["id"] not in reported
    assert len(whatsapp.messages()) == 2  # the dropped one was still accepted


async def test_a_held_answer_is_never_sent_when_the_stand_in_stops(
    whatsapp: WhatsAppServer,
) -> None:
    whatsapp.hold_answers()
    sending = asyncio.create_task(send(whatsapp, outbound("kept")))
    async with asyncio.timeout(10):
        await whatsapp.wait_until(lambda s: any(c.outcome == "held" for c in s.calls))
    assert [m.text for m in whatsapp.messages()] == ["kept"]
    assert not sending.done()
    await whatsapp.stop()
    with pytest.raises(aiohttp.ClientError):
        await sending
    assert whatsapp.calls[-1].outcome == "server_stopped"


async def test_a_held_answer_arrives_after_release(whatsapp: WhatsAppServer) -> None:
    whatsapp.hold_answers()
    sending = asyncio.create_task(send(whatsapp, outbound("held")))
    async with asyncio.timeout(10):
        await whatsapp.wait_until(lambda s: any(c.outcome == "held" for c in s.calls))
    whatsapp.release_answers()
    async with asyncio.timeout(10):
        status, _, answer = await sending
    assert (status, answer["messages"][0]["id"]) == (200, whatsapp.messages()[0].id)


async def test_inbound_helpers_sign_as_meta_and_a_forged_signature_fails(
    receiver: Receiver,
) -> None:
    body = text_message(sender=CUSTOMER, text="where is my order?", message_id="wamid.in1")
    raw = encode(body)
    assert verified(APP_SECRET, raw, sign(raw, APP_SECRET)["X-Hub-Signature-256"])
    assert not verified(APP_SECRET, raw + b" ", sign(raw, APP_SECRET)["X-Hub-Signature-256"])

    accepted = await deliver(receiver.url, body, APP_SECRET)
    forged = await deliver(
        receiver.url, body, APP_SECRET, headers={"X-Hub-Signature-256": "sha256=" + "0" * 64}
    )
    other_secret = await deliver(receiver.url, body, "another-secret")
    assert (accepted.status, forged.status, other_secret.status) == (200, 401, 401)
    valid, received = receiver.posts[0]
    value = received["entry"][0]["changes"][0]["value"]
    message = value["messages"][0]
    assert valid
    assert (message["from"], message["id"], message["type"]) == (CUSTOMER, "wamid.in1", "text")
    assert message["text"] == {"body": "where is my order?"}
    assert value["contacts"][0]["wa_id"] == CUSTOMER

    answered = await handshake(receiver.url, VERIFY_TOKEN, challenge="1158201444")
    assert (answered.status, answered.text) == (200, "1158201444")
    refused = await handshake(receiver.url, "wrong-token", challenge="1158201444")
    assert refused.status == 403


async def test_the_cli_serves_in_a_separate_process(receiver: Receiver) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(LIBS_DIR), env.get("PYTHONPATH")]))
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tether.testing.whatsapp_server",
        "--port",
        "0",
        "--access-token",
        "EAA-cli",
        "--app-secret",
        APP_SECRET,
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        assert process.stdout is not None
        async with asyncio.timeout(30):
            line = (await process.stdout.readline()).decode()
        announced = re.fullmatch(r"whatsapp listening (http://127\.0\.0\.1:\d+)\n", line)
        assert announced, line
        base = announced.group(1)
        async with aiohttp.ClientSession(base) as control:
            async with control.post("/_webhook", json={"url": receiver.url}) as r:
                assert r.status == 200
            script = {"fault": {"kind": "rate_limited", "retry_after": 2}}
            async with control.post("/_script", json=script) as r:
                assert r.status == 200
            for bad_plan in ("drop", {"drop": "yes"}, {"delay_s": "nan"}, {"delay_s": -1}):
                async with control.post("/_statuses", json={"plan": bad_plan}) as r:
                    assert r.status == 400, bad_plan
            async with control.post("/_hold", data=b"not json") as r:
                assert r.status == 400
            path = "/v21.0/106540352242922/messages"
            auth = {"Authorization": "Bearer EAA-cli"}
            async with control.post(path, json=outbound("a"), headers=auth) as r:
                assert (r.status, r.headers["Retry-After"]) == (429, "2")
            async with control.post(path, json=outbound("a"), headers=auth) as r:
                wamid = (await r.json())["messages"][0]["id"]
            async with control.get("/_messages", params={"to": CUSTOMER}) as r:
                stored = (await r.json())["messages"]
            async with control.get("/_requests") as r:
                statuses = [c["status"] for c in (await r.json())["requests"]]
        assert [(m["id"], m["text"]) for m in stored] == [(wamid, "a")]
        assert statuses == [429, 200]

        async def both_reported() -> bool:
            return len(receiver.statuses()) == 2

        await eventually(both_reported, what="sent and delivered at the receiver")
        assert [s["status"] for s in receiver.statuses()] == ["sent", "delivered"]
    finally:
        if process.returncode is None:
            process.terminate()
        await process.communicate()
    assert process.returncode == 0
