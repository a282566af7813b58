"""What the gateway's webhook endpoints read out of verified provider bodies, and the signatures
they accept: each provider's shape, built with the stand-ins' event builders and signed by their
independent hmac implementations."""

from __future__ import annotations

import json
import time

import pytest

from services.gateway.http import webhooks_generic, webhooks_slack, webhooks_whatsapp
from tether.errors import InvalidArgument, PermissionDenied, Unauthenticated
from tether.testing import slack_events, whatsapp_events


def test_slack_verifies_with_either_valid_secret_and_refuses_the_rest() -> None:
    raw = slack_events.encode(slack_events.url_verification("c"))
    headers = slack_events.sign(raw, "old")
    webhooks_slack.verify(raw, headers, ["new", "old"])
    for secrets, sent in (
        (["new"], headers),
        (["old"], {**headers, "X-Slack-Request-Timestamp": "abc"}),
        (["old"], {**headers, "X-Slack-Signature": "v0=é"}),
        (["old"], slack_events.sign(raw, "old", timestamp=int(time.time()) - 301)),
        (["old"], {}),
    ):
        with pytest.raises(Unauthenticated):
            webhooks_slack.verify(raw, sent, secrets)


def test_a_slack_message_in_a_thread_replies_in_it() -> None:
    body = slack_events.message_event(
        channel="C1", user="U1", text="hi", ts="2.000200", thread_ts="1.000100", event_id="Ev1"
    )
    found = webhooks_slack.message(body)
    assert found is not None
    assert (found.event_id, found.thread_id, found.sender_id, found.text) == (
        "Ev1", "C1:1.000100", "U1", "hi"
    )  # fmt: skip
    assert (found.address, found.thread, found.reply_to) == ("C1", "1.000100", "2.000200")


def test_whatsapp_ids_that_are_not_identifiers_still_dedupe_and_are_answered_as_named() -> None:
    body = whatsapp_events.text_message(sender="15551234567", text="hi", message_id="wamid.AB+c=")
    found = webhooks_whatsapp.parse(json.dumps(body).encode()).messages
    assert len(found) == 1
    assert found[0].event_id.startswith("wamid-sha256:")
    assert found[0].reply_to == "wamid.AB+c="  # the answer quotes the message as WhatsApp named it
    again = webhooks_whatsapp.parse(json.dumps(body).encode()).messages
    assert again[0].event_id == found[0].event_id


def test_whatsapp_subscription_check() -> None:
    query = whatsapp_events.subscription_query("tok", "42")
    assert webhooks_whatsapp.subscribe(query, "tok") == "42"
    for sent, token in ((query, "other"), (query, ""), ({**query, "hub.mode": "x"}, "tok")):
        with pytest.raises(PermissionDenied):
            webhooks_whatsapp.subscribe(sent, token)


def test_whatsapp_signature() -> None:
    raw = b'{"object":"whatsapp_business_account","entry":[]}'
    webhooks_whatsapp.verify(raw, whatsapp_events.sign(raw, "app"), ["app"])
    for headers in (whatsapp_events.sign(raw, "other"), {}, {"X-Hub-Signature-256": "sha1=00"}):
        with pytest.raises(Unauthenticated):
            webhooks_whatsapp.verify(raw, headers, ["app"])


@pytest.mark.parametrize(
    ("body", "pointer"),
    [
        ({"t": 1, "h": "a", "s": "b", "e": "c"}, "/t"),
        ({"h": "a", "s": "b", "e": "c"}, "/t"),
        ({"t": "x", "h": "a b", "s": "b", "e": "c"}, "/h"),
        ({"t": "x", "h": "a", "s": "b", "e": ["c"]}, "/e"),
    ],
)
def test_generic_pointers_name_what_is_wrong(body: dict[str, object], pointer: str) -> None:
    settings = {"text_field": "/t", "thread_field": "/h", "sender_field": "/s",
                "event_id_field": "/e"}  # fmt: skip
    with pytest.raises(InvalidArgument, match=pointer):
        webhooks_generic.message(json.dumps(body).encode(), settings)
