"""A delivery's rules: its id names the run's one answer, its states move only forward, its
outcome's event goes on the wire as the events proto names it, and the worker's reading of a
connection's URLs and of an agent's approvals."""

from __future__ import annotations

from services.worker.delivery import gates_replies
from services.worker.senders import slack_base_url, whatsapp_messages_url
from tether.convert import event_from_wire, event_to_wire
from tether.convert.deliveries import delivery_from_proto, delivery_to_proto
from tether.domain import Delivery, RunError, delivery_event, delivery_id
from tether.domain.deliveries import may_move


def test_every_attempt_of_a_run_names_the_same_delivery_and_no_other_run_does() -> None:
    assert delivery_id("t1", "run_1") == delivery_id("t1", "run_1")
    assert delivery_id("t1", "run_1") != delivery_id("t2", "run_1")
    assert delivery_id("t1", "run_1") != delivery_id("t1", "run_2")
    assert delivery_id("t1", "run_1").startswith("dlv_")
    assert len(delivery_id("t1", "run_1")) <= 64  # fits Slack metadata and WhatsApp's 512


def test_a_delivery_moves_forward_only() -> None:
    assert may_move("pending", "sent")
    assert may_move("pending", "pending")  # a provider call counted
    assert may_move("awaiting-approval", "pending")
    assert may_move("awaiting-approval", "denied")
    assert not may_move("awaiting-approval", "sent"), "nothing is sent before it is allowed"
    assert not may_move("pending", "awaiting-approval")
    for done in ("sent", "failed", "unknown", "denied"):
        assert not may_move(done, "pending")
        assert not may_move(done, "sent")
    assert not may_move("pending", "lost")


def test_an_outcome_goes_on_the_wire_as_its_delivery_event() -> None:
    failed = Delivery(
        delivery_id("t1", "run_1"),
        "run_1",
        "ch_1",
        "slack",
        "failed",
        "hi",
        error=RunError("delivery_refused", "Slack refused chat.postMessage: channel_not_found"),
    )
    event = delivery_event(failed)
    assert str(event.type) == "delivery.failed"
    assert event_from_wire(event_to_wire(event)) == event


def test_a_delivery_round_trips_its_wire_form() -> None:
    sent = Delivery(delivery_id("t", "r"), "r", "ch_1", "whatsapp", "sent", "hi", "wamid.1", 2)
    assert delivery_from_proto(delivery_to_proto(sent), "r") == sent


def test_the_sdk_base_url_of_a_slack_connection() -> None:
    assert slack_base_url("https://slack.com/api/") == "https://slack.com/api/"
    assert slack_base_url("http://127.0.0.1:9000") == "http://127.0.0.1:9000/api/"
    assert slack_base_url("http://127.0.0.1:9000/api") == "http://127.0.0.1:9000/api/"


def test_the_messages_url_of_a_whatsapp_connection() -> None:
    assert (
        whatsapp_messages_url("https://graph.facebook.com/v21.0/", "42")
        == "https://graph.facebook.com/v21.0/42/messages"
    )
    assert (
        whatsapp_messages_url("http://127.0.0.1:9", "42") == "http://127.0.0.1:9/v21.0/42/messages"
    )


def test_an_agents_approvals_gate_its_answers_only_when_they_name_send_reply() -> None:
    assert not gates_replies("")
    assert not gates_replies('{"risks": {"publish": {}}}')
    assert gates_replies('{"risks": {"send_reply": {"decisions": ["allow-once", "deny"]}}}')
    assert gates_replies('{"tools": {"send_reply": {}}}')
    assert gates_replies("not json"), "an unreadable policy gates (fail closed)"
