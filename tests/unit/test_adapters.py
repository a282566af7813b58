"""Adapters normalise every input kind and validate identifiers at ingress."""

from __future__ import annotations

import pytest

from services.admission.adapters import normalise
from tether.domain import ChannelOrigin, ReplyTarget, origin_from_json, origin_to_json
from tether.errors import InvalidArgument, PermissionDenied, StoredFormatTooNew
from tether.ids import is_identifier, new_id
from tether.v1 import admission_pb2, common_pb2

CALLER = admission_pb2.Caller(tenant_id="acme", principal_id="alice")


def req(**input_: object) -> admission_pb2.AdmitRequest:
    return admission_pb2.AdmitRequest(caller=CALLER, **input_)  # type: ignore[arg-type]


def test_messaging_event_keys_on_the_provider_event_id() -> None:
    event = normalise(
        req(
            messaging=admission_pb2.MessagingWebhookInput(
                provider="whatsapp",
                provider_event_id="message-104",
                thread_id="thread-example",
                sender_id="guest-example",
                sender_type="guest",
                text="Is there any update?",
            )
        )
    )
    assert event.idempotency_key == "messaging:whatsapp:message-104"
    assert (event.tenant_id, event.channel, event.conversation_id) == (
        "acme",
        "whatsapp",
        "thread-example",
    )
    assert (event.actor_type, event.actor_id, event.actor_scope) == (
        "guest",
        "guest-example",
        "thread:alice",
    )


def test_task_and_decision_inputs_become_events_with_context() -> None:
    task = normalise(
        req(
            task_status=admission_pb2.TaskStatusInput(
                task_id="T-9", status_event_id="ev-1", status="done", detail="shipped"
            )
        )
    )
    assert task.context == {"task_id": "T-9", "status": "done", "detail": "shipped"}
    assert task.actor_scope == "task:alice"
    assert task.text == "Task T-9 is now done. shipped"
    decision = normalise(
        req(
            decision=admission_pb2.DecisionInput(
                decision_id="d-1", conversation_id="c1", decision="refund approved"
            )
        )
    )
    assert decision.idempotency_key == "decision:d-1"
    assert decision.actor_scope == "principal:alice"


def test_every_conversation_is_scoped_to_the_callers_principal_never_the_body() -> None:
    """A thread or task id is a correlation value: the session's actor scope names the
    authenticated principal, whatever sender or tenant the body names."""
    inputs = {
        "chat": admission_pb2.ChatInput(event_id="e", conversation_id="c", text="hi"),
        "messaging": admission_pb2.MessagingWebhookInput(
            provider="whatsapp",
            provider_event_id="m",
            thread_id="th",
            sender_id="bob",
            sender_type="user",
            text="hi",
        ),
        "task_status": admission_pb2.TaskStatusInput(
            task_id="T-9", status_event_id="s", status="done"
        ),
        "decision": admission_pb2.DecisionInput(
            decision_id="d", conversation_id="c", decision="yes"
        ),
    }
    scopes = {}
    for principal in ("alice", "bob"):
        caller = admission_pb2.Caller(tenant_id="acme", principal_id=principal)
        for kind, body in inputs.items():
            request = admission_pb2.AdmitRequest(caller=caller, **{kind: body})  # type: ignore[arg-type]
            scopes[principal, kind] = normalise(request).actor_scope
    assert scopes == {
        ("alice", "chat"): "principal:alice",
        ("alice", "messaging"): "thread:alice",
        ("alice", "task_status"): "task:alice",
        ("alice", "decision"): "principal:alice",
        ("bob", "chat"): "principal:bob",
        ("bob", "messaging"): "thread:bob",
        ("bob", "task_status"): "task:bob",
        ("bob", "decision"): "principal:bob",
    }


def test_request_hash_covers_content_not_delivery() -> None:
    def chat(text: str) -> bytes:
        return normalise(
            req(chat=admission_pb2.ChatInput(event_id="e", conversation_id="c", text=text))
        ).request_hash()

    assert chat("yes") == chat("yes")
    assert chat("yes") != chat("no")


@pytest.mark.parametrize(
    ("chat", "field"),
    [
        ({"event_id": "", "conversation_id": "c", "text": "hi"}, "event_id"),
        ({"event_id": "has space", "conversation_id": "c", "text": "hi"}, "event_id"),
        ({"event_id": "x" * 129, "conversation_id": "c", "text": "hi"}, "event_id"),
        ({"event_id": "e", "conversation_id": "", "text": "hi"}, "conversation_id"),
        ({"event_id": "e", "conversation_id": "c/../d", "text": "hi"}, "conversation_id"),
        ({"event_id": "e", "conversation_id": "c", "text": "   "}, "text"),
        ({"event_id": "e", "conversation_id": "c", "text": "x" * 32_001}, "text"),
        (
            {"event_id": "e", "conversation_id": "c", "text": "hi", "channel": "bad channel"},
            "channel",
        ),
    ],
)
def test_bad_identifiers_and_text_are_invalid_arguments(chat: dict[str, str], field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        normalise(req(chat=admission_pb2.ChatInput(**chat)))
    assert info.value.details["field"] == field


def test_a_payload_naming_another_tenant_is_permission_denied() -> None:
    with pytest.raises(PermissionDenied):
        normalise(
            req(
                chat=admission_pb2.ChatInput(
                    event_id="e", conversation_id="c", text="hi", tenant_id="globex"
                )
            )
        )


def test_a_request_without_input_or_caller_is_invalid() -> None:
    with pytest.raises(InvalidArgument):
        normalise(req())
    with pytest.raises(InvalidArgument):
        normalise(
            admission_pb2.AdmitRequest(
                chat=admission_pb2.ChatInput(event_id="e", conversation_id="c", text="hi")
            )
        )


def test_ids_are_time_ordered_and_valid_identifiers() -> None:
    ids = [new_id("run") for _ in range(100)]
    assert all(is_identifier(i) for i in ids)
    assert [i[4:16] for i in ids] == sorted(i[4:16] for i in ids)


def _channel_request(principal: str, **reply: str) -> admission_pb2.AdmitRequest:
    target = {"channel_id": "ch_1", "kind": "slack", "address": "C1", "thread": "17.1"} | reply
    return admission_pb2.AdmitRequest(
        caller=admission_pb2.Caller(tenant_id="t1", principal_id=principal),
        channel_message=admission_pb2.ChannelMessageInput(
            channel_id="ch_1",
            event_id="Ev9",
            thread_id="C1:17.1",
            sender_id="U1",
            text="hello",
            reply=common_pb2.ReplyTarget(**target),
            agent="support",
        ),
    )


def test_a_channel_message_is_the_connections_and_records_where_its_answer_goes() -> None:
    event = normalise(_channel_request("channel:ch_1"))
    assert (event.principal_id, event.actor_scope) == ("channel:ch_1", "thread:channel:ch_1")
    assert event.idempotency_key == "channel:ch_1:Ev9"
    assert (event.source, event.channel, event.conversation_id) == ("messaging", "slack", "C1:17.1")
    assert event.actor_id == "U1" and event.visibility.value == "tenant"
    assert event.channel_origin == ChannelOrigin(
        ReplyTarget("ch_1", "slack", "C1", "17.1", ""), "support"
    )
    assert origin_from_json(origin_to_json(event.channel_origin)) == event.channel_origin


def test_a_channel_message_from_any_other_principal_or_naming_another_connection_is_refused() -> (
    None
):
    for principal in ("alice", "channel:ch_2", "channel:"):
        with pytest.raises(PermissionDenied):
            normalise(_channel_request(principal))
    with pytest.raises(InvalidArgument, match="another connection"):
        normalise(_channel_request("channel:ch_1", channel_id="ch_2"))
    with pytest.raises(InvalidArgument):
        normalise(_channel_request("channel:ch_1", address=""))


def test_a_stored_channel_origin_of_a_newer_format_or_with_unknown_fields_is_refused() -> None:
    stored = origin_to_json(ChannelOrigin(ReplyTarget("ch_1", "slack", "C1")))
    assert origin_from_json(None) is None
    for newer in ({**stored, "v": 2}, {**stored, "extra": 1}):
        with pytest.raises(StoredFormatTooNew):
            origin_from_json(newer)
    with pytest.raises(StoredFormatTooNew):
        origin_from_json({**stored, "reply": {**stored["reply"], "extra": "x"}})


def test_a_reply_target_keeps_the_providers_message_id_as_written() -> None:
    event = normalise(_channel_request("channel:ch_1", reply_to="wamid.HBgLMTU1NTEy+/QA="))
    assert event.channel_origin is not None
    assert event.channel_origin.reply.reply_to == "wamid.HBgLMTU1NTEy+/QA="
    for bad in ("has space", "tab\there", "x" * 257, "caf\u00e9"):
        with pytest.raises(InvalidArgument, match=r"reply\.reply_to"):
            normalise(_channel_request("channel:ch_1", reply_to=bad))
