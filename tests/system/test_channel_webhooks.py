"""Channel webhooks in, on one stack of real processes (no worker: runs stay queued): a signed
Slack event, WhatsApp message or Standard Webhooks delivery becomes one run whose reply target
is the verified connection's, a redelivery (concurrent, or Slack's retry) attaches to it, and a
forged, stale, unknown or misshapen one stores nothing. No secret reaches a service's log."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import aiohttp
import pytest

from tests.system.conftest import RunningStack
from tests.system.webhook_support import (
    Secrets,
    add_channel,
    body_of,
    counts,
    http_base,
    origin_of,
    standard_sign,
    statuses_of,
    whsec,
)
from tether.runtime.rpc import internal_channel
from tether.testing import slack_events, whatsapp_events
from tether.testing.eventually import eventually
from tether.v1 import interactions_pb2, interactions_pb2_grpc

USED = Secrets()
# Long enough, on a loaded machine, to see the new secret verify and the old one still verify.
GRACE_S = 12


async def _slack_channel(stack: RunningStack, agent: str = "") -> tuple[str, str, str]:
    signing = USED.new("signing")
    added = await add_channel(
        stack,
        {
            "kind": "slack",
            "agent": agent,
            "secrets": {"signingSecret": signing, "botToken": USED.new("xoxb")},
        },
    )
    return added["channelId"], added["webhookUrl"], signing


async def _lookup(
    stack: RunningStack, channel_id: str
) -> interactions_pb2.LookupChannelVerificationResponse:
    address = stack.services.addresses()["interactions"]
    async with internal_channel(address, stack.credentials["gateway"]) as channel:
        stub = interactions_pb2_grpc.InteractionsServiceStub(channel)
        found: interactions_pb2.LookupChannelVerificationResponse = (
            await stub.LookupChannelVerification(
                interactions_pb2.LookupChannelVerificationRequest(channel_id=channel_id)
            )
        )
        return found


def _ts() -> str:
    return f"{time.time():.6f}"


async def test_a_signed_slack_message_becomes_one_run_replying_in_its_thread(
    stack: RunningStack,
) -> None:
    channel_id, url, signing = await _slack_channel(stack, agent="support")
    challenge = slack_events.url_verification()
    answered = await slack_events.deliver(url, challenge, signing)
    assert answered.status == 200, answered.text
    assert answered.json() == {"challenge": challenge["challenge"]}

    before = await counts(stack)
    ts = _ts()
    ignored = [
        slack_events.message_event(channel="C1", user="U1", text="bot", ts=ts, bot_id="B1"),
        slack_events.message_event(
            channel="C1", user="U1", text="edit", ts=ts, subtype="message_changed"
        ),
        slack_events.message_event(
            channel="C1", user="U1", text="joined", ts=ts, subtype="channel_join"
        ),
        {**slack_events.message_event(channel="C1", user="U1", text="x", ts=ts),
         "event": {"type": "reaction_added", "user": "U1"}},
        {"type": "app_rate_limited", "team_id": "T1", "minute_rate_limited": 1},
    ]  # fmt: skip
    for body in ignored:
        answer = await slack_events.deliver(url, body, signing)
        assert answer.status == 200, answer.text
        assert answer.json() == {"run_id": "", "disposition": "ignored"}
    assert await counts(stack) == before

    thread_ts = _ts()
    reply_ts = _ts()
    event = slack_events.message_event(
        channel="C0GENERAL", user="U0ALICE", text="where is my order?", ts=reply_ts,
        thread_ts=thread_ts,
    )  # fmt: skip
    answer = await slack_events.deliver(url, event, signing)
    assert answer.status == 200, answer.text
    assert answer.json()["disposition"] == "created"
    run_id = answer.json()["run_id"]
    origin, tenant, text = await origin_of(stack, run_id)
    assert tenant == "ops" and text == "where is my order?"
    assert origin == {
        "v": 1,
        "reply": {
            "channel_id": channel_id,
            "kind": "slack",
            "address": "C0GENERAL",
            "thread": thread_ts,
            "reply_to": reply_ts,
        },
        "agent": "support",
    }
    after = await counts(stack)
    assert after["runs"] == before["runs"] + 1 and after["messages"] == before["messages"] + 1

    # A top-level message is its own thread; the run is visible tenant-wide (runs:all).
    top = slack_events.message_event(channel="C0GENERAL", user="U0ALICE", text="hi", ts=_ts())
    answer = await slack_events.deliver(url, top, signing)
    assert answer.status == 200, answer.text
    origin, _, _ = await origin_of(stack, answer.json()["run_id"])
    assert origin["reply"]["thread"] == origin["reply"]["reply_to"] == top["event"]["ts"]
    async with aiohttp.ClientSession() as http:
        shown = await http.get(
            f"{http_base(stack)}/v2/runs/{answer.json()['run_id']}",
            headers={"Authorization": f"Bearer {stack.admin_key}"},
        )
        assert shown.status == 200, await shown.text()


async def test_the_same_event_twenty_times_at_once_and_retried_is_one_run(
    stack: RunningStack,
) -> None:
    _, url, signing = await _slack_channel(stack)
    event = slack_events.message_event(channel="C1", user="U1", text="once", ts=_ts())
    before = await counts(stack)
    async with aiohttp.ClientSession() as http:
        answers = await asyncio.gather(
            *(slack_events.deliver(url, event, signing, session=http) for _ in range(20))
        )
        retried = await slack_events.deliver(
            url, event, signing, retry_num=1, retry_reason="http_timeout", session=http
        )
    assert all(a.status == 200 for a in answers), [a.text for a in answers]
    run_ids = {a.json()["run_id"] for a in [*answers, retried]}
    assert len(run_ids) == 1 and "" not in run_ids
    assert [a.json()["disposition"] for a in answers].count("created") == 1
    assert retried.json()["disposition"] == "attached"
    after = await counts(stack)
    assert after["runs"] == before["runs"] + 1
    assert after["event_claims"] == before["event_claims"] + 1


async def test_forged_stale_unknown_and_misshapen_deliveries_store_nothing(
    stack: RunningStack,
) -> None:
    channel_id, url, signing = await _slack_channel(stack)
    event = slack_events.message_event(channel="C1", user="U1", text="x", ts=_ts())
    before = await counts(stack)

    forged = await slack_events.deliver(url, event, USED.new("not-the-secret"))
    assert forged.status == 401, forged.text
    assert forged.json()["error"]["status"] == "UNAUTHENTICATED"
    stale = await slack_events.deliver(url, event, signing, timestamp=int(time.time()) - 301)
    assert stale.status == 401, stale.text
    unsigned = await slack_events.deliver(
        url, event, signing, headers={"X-Slack-Signature": "", "X-Slack-Request-Timestamp": "x"}
    )
    assert unsigned.status == 401, unsigned.text
    # The signature covers the body: the same headers over another body are forged.
    signed = slack_events.sign(slack_events.encode(event), signing)
    tampered = {**event, "event": {**event["event"], "text": "transfer everything"}}
    answer = await slack_events.deliver(url, tampered, signing, headers=signed)
    assert answer.status == 401, answer.text

    base = url.rsplit("/v2/", 1)[0]
    unknown = await slack_events.deliver(
        f"{base}/v2/webhooks/slack/ch_{uuid.uuid4().hex}", event, signing
    )
    mismatch = await slack_events.deliver(
        f"{base}/v2/webhooks/webhook/{channel_id}", event, signing
    )
    wa_mismatch = await slack_events.deliver(
        f"{base}/v2/webhooks/whatsapp/{channel_id}", event, signing
    )
    assert unknown.status == mismatch.status == wa_mismatch.status == 404
    assert unknown.text == mismatch.text == wa_mismatch.text
    assert unknown.json()["error"]["status"] == "NOT_FOUND"

    for shapeless in (b"[1, 2]", b"not json", b'{"type": 7}', b'{"type":"event_callback"}'):
        answer = await slack_events.deliver(url, shapeless, signing)
        assert answer.status == 400, (shapeless, answer.text)
        assert answer.json()["error"]["status"] == "INVALID_ARGUMENT"
    long_channel = slack_events.message_event(channel="C" * 120, user="U1", text="x", ts=_ts())
    answer = await slack_events.deliver(url, long_channel, signing)
    assert answer.status == 400 and "thread" in answer.json()["error"]["message"], answer.text

    async with aiohttp.ClientSession() as http:
        huge = b'{"type":"event_callback","pad":"' + b"x" * (2 << 20) + b'"}'
        async with http.post(url, data=huge, headers=slack_events.sign(huge, signing)) as big:
            assert big.status == 413, await big.text()
    assert await counts(stack) == before


@pytest.mark.slow
async def test_the_previous_secret_verifies_during_the_grace_and_not_after(
    stack: RunningStack,
) -> None:
    channel_id, url, old = await _slack_channel(stack)

    def event() -> dict[str, Any]:
        return slack_events.message_event(channel="C1", user="U1", text="r", ts=_ts())

    assert (await slack_events.deliver(url, event(), old)).status == 200  # now kept 60 s
    new = USED.new("rotated")
    async with aiohttp.ClientSession() as http:
        rotated = await http.post(
            f"{http_base(stack)}/v2/channels/{channel_id}/rotate-secret",
            json={"secret": new, "graceSeconds": GRACE_S},
            headers={"Authorization": f"Bearer {stack.admin_key}"},
        )
        assert rotated.status == 200, await rotated.text()
    rotated_at = time.monotonic()

    async def new_one_verifies() -> bool:
        return (await slack_events.deliver(url, event(), new)).status == 200

    # The kept answer knows only the old secret: a miss asks again within seconds.
    await eventually(new_one_verifies, timeout=6, interval=0.2, what="the new secret to verify")
    assert (await slack_events.deliver(url, event(), old)).status == 200
    assert time.monotonic() - rotated_at < GRACE_S, "the grace ended before the old one was tried"

    async def old_one_refused() -> bool:
        return (await slack_events.deliver(url, event(), old)).status == 401

    await eventually(old_one_refused, timeout=GRACE_S + 5, interval=0.2, what="the grace to end")
    assert time.monotonic() - rotated_at >= GRACE_S - 1  # the gateway's clock against the DB's
    assert (await slack_events.deliver(url, event(), new)).status == 200


async def test_whatsapp_handshake_messages_and_statuses(stack: RunningStack) -> None:
    app_secret, verify_token = USED.new("app"), USED.new("verify")
    access_token = USED.new("access")
    added = await add_channel(
        stack,
        {
            "kind": "whatsapp",
            "agent": "sales",
            "secrets": {
                "appSecret": app_secret,
                "verifyToken": verify_token,
                "accessToken": access_token,
            },
            "settings": {"phoneNumberId": "106540352242922"},
        },
    )
    channel_id, url = added["channelId"], added["webhookUrl"]
    # What the gateway is given verifies; nothing in it sends.
    looked_up = await _lookup(stack, channel_id)
    assert (list(looked_up.secrets), looked_up.verify_token) == ([app_secret], verify_token)
    assert (looked_up.agent, looked_up.settings.phone_number_id) == ("sales", "106540352242922")
    assert access_token.encode() not in looked_up.SerializeToString()

    ok = await whatsapp_events.handshake(url, verify_token, challenge="1158201444")
    assert ok.status == 200 and ok.text == "1158201444", ok.text
    wrong = await whatsapp_events.handshake(url, verify_token + "x", challenge="1")
    assert wrong.status == 403, wrong.text
    async with aiohttp.ClientSession() as http:
        query = {**whatsapp_events.subscription_query(verify_token), "hub.mode": "unsubscribe"}
        async with http.get(url, params=query) as refused:
            assert refused.status == 403

    before = await counts(stack)
    body = whatsapp_events.text_message(sender="15551234567", text="hola")
    forged = await whatsapp_events.deliver(url, body, USED.new("not-the-app-secret"))
    assert forged.status == 401, forged.text
    unsigned = await whatsapp_events.deliver(
        url, body, app_secret, headers={"X-Hub-Signature-256": ""}
    )
    assert unsigned.status == 401, unsigned.text
    shapeless = await whatsapp_events.deliver(url, {"object": "page", "entry": []}, app_secret)
    assert shapeless.status == 400, shapeless.text
    assert await counts(stack) == before

    answer = await whatsapp_events.deliver(url, body, app_secret)
    assert answer.status == 200, answer.text
    assert answer.json()["disposition"] == "created"
    again = await whatsapp_events.deliver(url, body, app_secret)
    assert again.json()["run_id"] == answer.json()["run_id"]
    message = body["entry"][0]["changes"][0]["value"]["messages"][0]
    origin, tenant, text = await origin_of(stack, answer.json()["run_id"])
    assert tenant == "ops" and text == "hola"
    assert origin["reply"] == {
        "channel_id": channel_id,
        "kind": "whatsapp",
        "address": "15551234567",
        "thread": "",
        "reply_to": message["id"],
    }
    assert origin["agent"] == "sales"

    status = whatsapp_events.status_update(
        message_id="wamid.sent-1", status="delivered", recipient_id="15551234567",
        biz_opaque_callback_data="dl_123",
    )  # fmt: skip
    for _ in range(2):
        recorded = await whatsapp_events.deliver(url, status, app_secret)
        assert recorded.status == 200, recorded.text
        assert recorded.json()["disposition"] == "ignored"
    rows = await statuses_of(stack, channel_id)
    assert [(r["provider_message_id"], r["status"], r["callback_data"]) for r in rows] == [
        ("wamid.sent-1", "delivered", "dl_123")
    ]
    assert rows[0]["tenant_id"] == "ops" and rows[0]["errors"] is None


async def test_a_standard_webhooks_delivery_is_mapped_by_the_connections_pointers(
    stack: RunningStack,
) -> None:
    secret = USED.whsec()
    added = await add_channel(
        stack,
        {
            "kind": "webhook",
            "secrets": {"secret": secret},
            "settings": {
                "textField": "/message/text",
                "threadField": "/conversation/id",
                "senderField": "/from~1user",
                "eventIdField": "/id",
            },
        },
    )
    channel_id, url = added["channelId"], added["webhookUrl"]
    event_id = f"evt_{uuid.uuid4().hex}"
    body = body_of(
        {
            "id": event_id,
            "message": {"text": "status of ticket 42?"},
            "conversation": {"id": "ticket-42"},
            "from/user": "agent.smith",
        }
    )
    before = await counts(stack)
    async with aiohttp.ClientSession() as http:

        async def post(raw: bytes, headers: dict[str, str]) -> tuple[int, Any]:
            async with http.post(url, data=raw, headers=headers) as answer:
                return answer.status, await answer.json()

        status, forged = await post(body, standard_sign(whsec(), body))
        assert status == 401, forged
        status, stale = await post(
            body, standard_sign(secret, body, timestamp=int(time.time()) - 400)
        )
        assert status == 401, stale
        status, missing = await post(body, {"Content-Type": "application/json"})
        assert status == 401, missing
        for bad, pointer in (
            ({"id": event_id, "message": {"text": 7}, "conversation": {"id": "t"},
              "from/user": "u"}, "/message/text"),
            ({"id": event_id, "message": {}, "conversation": {"id": "t"}, "from/user": "u"},
             "/message/text"),
            ({"id": event_id, "message": {"text": "x"}, "conversation": {"id": "t"}},
             "/from~1user"),
        ):  # fmt: skip
            raw = body_of(bad)
            status, refused = await post(raw, standard_sign(secret, raw))
            assert status == 400, refused
            assert pointer in refused["error"]["message"], refused
        assert await counts(stack) == before

        status, answer = await post(body, standard_sign(secret, body))
        assert status == 200, answer
        assert answer["disposition"] == "created"
        status, again = await post(body, standard_sign(secret, body))
        assert (status, again["run_id"]) == (200, answer["run_id"])
    origin, _, text = await origin_of(stack, answer["run_id"])
    assert text == "status of ticket 42?"
    assert origin["reply"] == {
        "channel_id": channel_id,
        "kind": "webhook",
        "address": "ticket-42",
        "thread": "",
        "reply_to": event_id,
    }


async def test_a_webhook_connection_takes_a_standard_webhooks_secret_only(
    stack: RunningStack,
) -> None:
    async with aiohttp.ClientSession() as http:
        refused = await http.post(
            f"{http_base(stack)}/v2/channels",
            json={
                "kind": "webhook",
                "name": f"hook-{uuid.uuid4().hex[:6]}",
                "secrets": {"secret": "plain-text-secret-not-base64"},
                "settings": {
                    "textField": "/t",
                    "threadField": "/h",
                    "senderField": "/s",
                    "eventIdField": "/e",
                },
            },
            headers={"Authorization": f"Bearer {stack.admin_key}"},
        )
        assert refused.status == 400
        assert "whsec_" in (await refused.json())["error"]["message"]


async def test_no_secret_reaches_a_service_log(stack: RunningStack) -> None:
    """Last in the module: every secret the tests above used, looked for in every log."""
    assert len(USED.values) >= 8
    for name, process in stack.services.procs.items():
        log = process.log_path.read_text(errors="replace")
        for value in USED.values:
            assert value not in log, f"{name}'s log holds a secret"
    gateway_log = stack.services.procs["gateway"].log_path.read_text(errors="replace")
    assert "webhook slack" in gateway_log and "webhook whatsapp" in gateway_log  # logged at all
    assert "v0=" not in gateway_log and "sha256=" not in gateway_log
