"""Adapters: each wire input (chat, messaging webhook, task status, decision) becomes one
normalised InboundEvent. This is the service's edge, so it reads protobuf; nothing past it does.

Identifiers are validated here, at ingress, and a payload naming another tenant is refused;
every field's size and characters were checked before (`tether.limits`, in the servicer).
"""

from __future__ import annotations

from google.protobuf import json_format

from services.admission.domain import ConversationKind, InboundEvent
from tether import priorities
from tether.domain.channels import ChannelOrigin, ReplyTarget, channel_principal
from tether.errors import InvalidArgument, PermissionDenied
from tether.ids import is_identifier
from tether.limits import ID_CHARS, TEXT_CHARS
from tether.v1 import admission_pb2
from tether.visibility import Visibility

MAX_TEXT_CHARS = TEXT_CHARS
MAX_ID_CHARS = ID_CHARS


def _identifier(name: str, value: str, *, required: bool = True) -> str:
    if not value and not required:
        return value
    if not is_identifier(value, max_length=MAX_ID_CHARS):
        raise InvalidArgument(
            f"{name} must be 1-{MAX_ID_CHARS} characters of letters, digits and . _ : @ - "
            f"(starting with a letter or digit); got {value[:40]!r}",
            details={"field": name},
        )
    return value


def _printable(name: str, value: str, size: int = 256) -> str:
    if len(value) > size or not all(" " < c < "\x7f" for c in value):
        raise InvalidArgument(
            f"{name} must be at most {size} printable ASCII characters without spaces",
            details={"field": name},
        )
    return value


def _text(name: str, value: str) -> str:
    if not value.strip():
        raise InvalidArgument(f"{name} must not be empty", details={"field": name})
    if len(value) > MAX_TEXT_CHARS:
        raise InvalidArgument(
            f"{name} is {len(value)} characters; the limit is {MAX_TEXT_CHARS}",
            details={"field": name},
        )
    return value


def _tenant(caller: admission_pb2.Caller, claimed: str) -> None:
    if claimed and claimed != caller.tenant_id:
        raise PermissionDenied(
            "the payload names a tenant other than the one your API key belongs to",
            details={"field": "tenant_id"},
        )


def normalise(request: admission_pb2.AdmitRequest) -> InboundEvent:
    """The InboundEvent for a request, or InvalidArgument/PermissionDenied naming the problem."""
    caller = request.caller
    if not caller.tenant_id or not caller.principal_id:
        raise InvalidArgument("caller identity is missing; calls must come through the gateway")
    kind = request.WhichOneof("input")
    if kind == "chat":
        return _chat(caller, request.chat)
    if kind == "messaging":
        return _messaging(caller, request.messaging)
    if kind == "task_status":
        return _task(caller, request.task_status)
    if kind == "decision":
        return _decision(caller, request.decision)
    if kind == "channel_message":
        return _channel_message(caller, request.channel_message)
    raise InvalidArgument("exactly one input (chat, messaging, task_status, decision) is required")


def _chat(caller: admission_pb2.Caller, chat: admission_pb2.ChatInput) -> InboundEvent:
    _tenant(caller, chat.tenant_id)
    event_id = _identifier("event_id", chat.event_id)
    return InboundEvent(
        tenant_id=caller.tenant_id,
        principal_id=caller.principal_id,
        source="chat",
        event_id=event_id,
        idempotency_key=f"chat:{event_id}",
        actor_type="user",
        actor_id=caller.principal_id,
        conversation_kind=ConversationKind.CHAT,
        channel=_identifier("channel", chat.channel or "chat"),
        conversation_id=_identifier("conversation_id", chat.conversation_id),
        text=_text("text", chat.text),
        priority=priorities.rank(chat.priority),
    )


def _messaging(
    caller: admission_pb2.Caller, msg: admission_pb2.MessagingWebhookInput
) -> InboundEvent:
    _tenant(caller, msg.tenant_id)
    provider = _identifier("provider", msg.provider)
    event_id = _identifier("provider_event_id", msg.provider_event_id)
    return InboundEvent(
        tenant_id=caller.tenant_id,
        principal_id=caller.principal_id,
        source="messaging",
        event_id=event_id,
        idempotency_key=f"messaging:{provider}:{event_id}",
        # The sender the body names is actor data only: the run is the integration key's.
        actor_type=_identifier("sender_type", msg.sender_type or "guest"),
        actor_id=_identifier("sender_id", msg.sender_id),
        # The thread id is the provider's correlation value, never access: a principal naming
        # another principal's thread opens a conversation of its own.
        conversation_kind=ConversationKind.THREAD,
        channel=provider,
        conversation_id=_identifier("thread_id", msg.thread_id),
        text=_text("text", msg.text),
        visibility=Visibility.TENANT,
    )


def _channel_message(
    caller: admission_pb2.Caller, msg: admission_pb2.ChannelMessageInput
) -> InboundEvent:
    channel_id = _identifier("channel_id", msg.channel_id)
    # The gateway builds this input only from a webhook verified against the connection's
    # secret, as the connection's principal: any other caller naming a connection is refused.
    if caller.principal_id != channel_principal(channel_id):
        raise PermissionDenied(
            "a channel message is admitted only as its connection's principal",
            details={"field": "channel_id"},
        )
    reply = msg.reply
    if reply.channel_id != channel_id:
        raise InvalidArgument(
            "the reply target names another connection", details={"field": "reply.channel_id"}
        )
    kind = _identifier("reply.kind", reply.kind)
    event_id = _identifier("event_id", msg.event_id)
    target = ReplyTarget(
        channel_id,
        kind,
        _identifier("reply.address", reply.address),
        _identifier("reply.thread", reply.thread, required=False),
        _printable("reply.reply_to", reply.reply_to),
    )
    return InboundEvent(
        tenant_id=caller.tenant_id,
        principal_id=caller.principal_id,
        source="messaging",
        event_id=event_id,
        # Keyed within the connection: two connections' providers may reuse an id.
        idempotency_key=f"channel:{channel_id}:{event_id}",
        actor_type="guest",
        actor_id=_identifier("sender_id", msg.sender_id),
        # The session is the connection's (its principal) and the provider's thread: two
        # connections naming the same thread id never share a conversation.
        conversation_kind=ConversationKind.THREAD,
        channel=kind,
        conversation_id=_identifier("thread_id", msg.thread_id),
        text=_text("text", msg.text),
        visibility=Visibility.TENANT,
        channel_origin=ChannelOrigin(target, _identifier("agent", msg.agent, required=False)),
    )


def _task(caller: admission_pb2.Caller, task: admission_pb2.TaskStatusInput) -> InboundEvent:
    _tenant(caller, task.tenant_id)
    event_id = _identifier("status_event_id", task.status_event_id)
    task_id = _identifier("task_id", task.task_id)
    status = _identifier("status", task.status)
    detail = task.detail[:MAX_TEXT_CHARS]
    return InboundEvent(
        tenant_id=caller.tenant_id,
        principal_id=caller.principal_id,
        source="task",
        event_id=event_id,
        idempotency_key=f"task:{event_id}",
        actor_type="system",
        actor_id=caller.principal_id,
        conversation_kind=ConversationKind.TASK,
        channel="task",
        conversation_id=task_id,
        text=f"Task {task_id} is now {status}." + (f" {detail}" if detail else ""),
        context={"task_id": task_id, "status": status, "detail": detail},
        visibility=Visibility.TENANT,
    )


def _decision(caller: admission_pb2.Caller, dec: admission_pb2.DecisionInput) -> InboundEvent:
    _tenant(caller, dec.tenant_id)
    event_id = _identifier("decision_id", dec.decision_id)
    decision = _text("decision", dec.decision)
    note = dec.note[:MAX_TEXT_CHARS]
    return InboundEvent(
        tenant_id=caller.tenant_id,
        principal_id=caller.principal_id,
        source="decision",
        event_id=event_id,
        idempotency_key=f"decision:{event_id}",
        actor_type="user",
        actor_id=caller.principal_id,
        # A decision joins the chat conversation it concerns.
        conversation_kind=ConversationKind.CHAT,
        channel="chat",
        conversation_id=_identifier("conversation_id", dec.conversation_id),
        text=f"Decision: {decision}" + (f" ({note})" if note else ""),
        context={"decision": decision, "note": note},
    )


def event_to_proto(event: InboundEvent) -> admission_pb2.InboundEvent:
    """The wire form of a normalised event."""
    out = admission_pb2.InboundEvent(
        tenant_id=event.tenant_id,
        event_id=event.event_id,
        idempotency_scope=event.idempotency_scope,
        idempotency_key=event.idempotency_key,
        source=event.source,
        actor_type=event.actor_type,
        actor_id=event.actor_id,
        channel=event.channel,
        channel_conversation_id=event.conversation_id,
        text=event.text,
    )
    json_format.ParseDict(event.context, out.context)
    return out
