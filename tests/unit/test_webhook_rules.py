"""The run-event webhook rules that need no database: which event types a subscription may name,
what a signing secret must be, how long a failed delivery waits, and the body and headers a
subscriber verifies with the standardwebhooks package."""

from __future__ import annotations

import base64
import json
import os
from datetime import UTC, datetime

import pytest
from standardwebhooks import Webhook

from services.orchestrator.webhook_dispatch import signed_headers
from services.orchestrator.webhooks import EVENT_TYPES, check_events, check_secret, retry_delay
from tether.convert.webhooks import webhook_body
from tether.errors import InvalidArgument


def test_event_types_are_checked_and_an_unknown_one_names_the_allowed() -> None:
    assert check_events(["run.completed", "delivery.sent", "run.completed"]) == [
        "run.completed",
        "delivery.sent",
    ]
    with pytest.raises(InvalidArgument) as refused:
        check_events(["run.completed", "run.started"])
    assert "'run.started'" in str(refused.value)
    assert all(name in str(refused.value) for name in EVENT_TYPES)
    with pytest.raises(InvalidArgument):
        check_events([])


@pytest.mark.parametrize(
    "secret",
    [
        "",
        "whsec_",
        "whsec_not base64!",
        base64.b64encode(os.urandom(32)).decode(),  # no prefix
        "whsec_" + base64.b64encode(os.urandom(8)).decode(),  # too short to be a key
        "whsec_" + base64.b64encode(os.urandom(65)).decode(),  # past the specification's 64
    ],
)
def test_a_secret_that_is_not_a_standard_webhooks_one_is_refused(secret: str) -> None:
    with pytest.raises(InvalidArgument, match="whsec_"):
        check_secret(secret)


def test_a_standard_webhooks_secret_passes_padded_or_not() -> None:
    encoded = base64.b64encode(os.urandom(32)).decode()
    check_secret("whsec_" + encoded)
    check_secret("whsec_" + encoded.rstrip("="))


def test_retries_double_from_the_base_up_to_the_bound_less_at_most_half() -> None:
    top = [retry_delay(n, 5.0, 60.0, jitter=lambda: 0.0).total_seconds() for n in range(1, 8)]
    assert top == [5.0, 10.0, 20.0, 40.0, 60.0, 60.0, 60.0]
    low = [retry_delay(n, 5.0, 60.0, jitter=lambda: 1.0).total_seconds() for n in range(1, 4)]
    assert low == [2.5, 5.0, 10.0]
    # A delivery tried a thousand times neither overflows nor waits past the bound.
    assert retry_delay(1000, 5.0, 60.0).total_seconds() <= 60.0


def test_the_body_is_the_streamed_event_and_its_signature_verifies() -> None:
    created = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
    body = webhook_body("run_1", 7, "run.completed", {"resultText": "done"}, created, format=1)
    secret = "whsec_" + base64.b64encode(os.urandom(32)).decode()
    now = datetime.now(UTC)
    headers = signed_headers(Webhook(secret), "msg_1", body, now)
    assert headers["webhook-id"] == "msg_1"
    assert Webhook(secret).verify(body, headers) == json.loads(body)
    parsed = json.loads(body)
    assert parsed["type"] == "run.completed" and parsed["timestamp"] == "2026-12-04T12:00:00Z"
    assert parsed["data"]["runId"] == "run_1" and parsed["data"]["seq"] == "7"
    assert "runCompleted" in parsed["data"]
    other = "whsec_" + base64.b64encode(os.urandom(32)).decode()
    with pytest.raises(Exception, match="signature"):
        Webhook(other).verify(body, headers)


def test_a_type_this_release_cannot_parse_is_sent_as_stored() -> None:
    # A later release's event type, stored by it while this one dispatches.
    stored = {"timerId": "tm_1"}
    created = datetime(2026, 12, 4, tzinfo=UTC)
    parsed = json.loads(webhook_body("run_1", 3, "timer.fired", stored, created, format=1))
    assert parsed["type"] == "timer.fired"
    assert parsed["data"]["timer_fired"] == {"timerId": "tm_1"}


def test_a_delivery_event_is_sent_in_the_event_streams_shape() -> None:
    stored = {"deliveryId": "dl_1", "channelId": "ch_1", "kind": "slack"}
    created = datetime(2026, 12, 4, tzinfo=UTC)
    parsed = json.loads(webhook_body("run_1", 3, "delivery.sent", stored, created))
    assert parsed["type"] == "delivery.sent" and parsed["data"]["type"] == "delivery.sent"
    assert parsed["data"]["deliverySent"]["deliveryId"] == "dl_1"
