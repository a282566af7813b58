"""A channel's whole round trip with the services as processes and the providers' stand-ins: a
person's message reaches the gateway as the provider delivers it (signed, no API key), becomes
one run, and the agent's answer goes back out through the same connection, once: Slack's in the
message's thread, WhatsApp's to its sender after the subscription handshake."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.system.delivery_support import Rig, delivery_of, delivery_rig
from tests.system.execution_support import wait_for_status
from tether.testing import slack_events, whatsapp_events
from tether.testing.model_server import TextTurn

# a whole stack of processes per module: tens of seconds, so in `make slow` (the 15-minute budget)
pytestmark = [pytest.mark.system, pytest.mark.slow]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def rig(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Rig]:
    run_dir = Path(tmp_path_factory.mktemp("round-trip"))
    async with delivery_rig(pg_server_url, template_db, redis_url, run_dir) as rig:
        yield rig


def webhook_url(rig: Rig, kind: str, channel_id: str) -> str:
    return (
        f"http://{rig.stack.services.http_addresses()['gateway']}/v2/webhooks/{kind}/{channel_id}"
    )


async def test_a_signed_slack_message_is_answered_once_in_its_thread(rig: Rig) -> None:
    tenant = await rig.stack.tenant()
    channel_id = await rig.add_channel(tenant, "slack")
    text = f"where is my order? {uuid.uuid4().hex}"
    rig.stack.model.script(text, [TextTurn("It ships today.")])
    # The stand-in stores the person's message and gives the event Slack would send for it.
    body = rig.slack.user_message("C0ROUND", "U0ALICE", text)
    url = webhook_url(rig, "slack", channel_id)
    first = await slack_events.deliver(url, body, "sig-secret")
    assert first.status == 200, first.text
    retried = await slack_events.deliver(url, body, "sig-secret", retry_num=1, retry_reason="x")
    assert retried.json()["run_id"] == first.json()["run_id"]
    run_id = first.json()["run_id"]
    run = await wait_for_status(rig.db_url, run_id, "completed", "failed", timeout=30)
    assert run.status == "completed"
    ts = body["event"]["ts"]
    thread = rig.slack.thread("C0ROUND", ts)
    assert [(m.text, m.bot_id is not None) for m in thread] == [
        (text, False),
        ("It ships today.", True),
    ]
    delivery = await delivery_of(rig.db_url, run_id)
    assert (delivery.state, delivery.provider_message_id) == ("sent", thread[1].ts)


async def test_whatsapps_handshake_then_a_signed_message_is_answered_to_its_sender(
    rig: Rig,
) -> None:
    tenant = await rig.stack.tenant()
    channel_id = await rig.add_channel(tenant, "whatsapp")
    url = webhook_url(rig, "whatsapp", channel_id)
    shook = await whatsapp_events.handshake(url, "verify-me", challenge="4242")
    assert (shook.status, shook.text) == (200, "4242")
    text = f"hola {uuid.uuid4().hex}"
    sender = f"1555{uuid.uuid4().int % 10**7:07d}"
    rig.stack.model.script(text, [TextTurn("Hola, ya sale.")])
    # A real wamid is base64 and often ends in '=': the answer still quotes it.
    wamid = "wamid.HBgLMTU1NTEyMzQ1NjcVAgASGBQzQTFFQjQ1RjA2QjI5QjQwNUQ4OQA="
    body = whatsapp_events.text_message(sender=sender, text=text, message_id=wamid)
    admitted = await whatsapp_events.deliver(url, body, rig.whatsapp.app_secret)
    assert admitted.status == 200, admitted.text
    run_id = admitted.json()["run_id"]
    run = await wait_for_status(rig.db_url, run_id, "completed", "failed", timeout=30)
    assert run.status == "completed"
    (answer,) = rig.whatsapp.messages(sender)
    assert (answer.text, answer.context_message_id) == ("Hola, ya sale.", wamid)
    delivery = await delivery_of(rig.db_url, run_id)
    assert (delivery.state, answer.biz_opaque_callback_data) == ("sent", delivery.delivery_id)
