"""What every field of a public request may hold, in one table, and the one check that enforces it.

Each limit is also written in the field's comment in `protos/tether/v1/*.proto`, in the words of
`Limit.describe()` (a unit test keeps the two the same). `check_request` walks a request with its
descriptor, so nested inputs, repeated fields and maps are checked the same way; an enum field
must hold one of its declared numbers. A refusal is INVALID_ARGUMENT naming the field.

Strings never carry NUL (PostgreSQL text and JSONB refuse it) or lone surrogates (not Unicode).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from tether.errors import InvalidArgument
from tether.ids import is_identifier

ID_CHARS = 128
TEXT_CHARS = 32_000
# A knowledge document: a title to list it by, and text enough for a policy or a manual's page.
DOCUMENT_TITLE_CHARS = 200
DOCUMENT_CHARS = 64_000
SECRET_CHARS = 65_536
# A channel's URL or JSON pointer.
CHANNEL_SETTING_CHARS = 2048
INT32_MAX = (1 << 31) - 1
INT64_MAX = (1 << 63) - 1

Kind = Literal["identifier", "text", "label", "token", "integer", "struct", "timestamp", "items"]

_NOT_UNICODE = re.compile("[\x00\ud800-\udfff]")
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
_TOKEN = re.compile("[\x21-\x7e]*")


@dataclass(frozen=True)
class Limit:
    """What one field may hold.

    identifier: `tether.ids.is_identifier` of at most `size` (empty only when not `required`);
    text: at most `size` characters, any but NUL; label: at most `size` characters, no control
    characters; token: at most `size` printable ASCII characters; integer: 0..`size`; struct: at
    most `size` bytes encoded; timestamp: a google.protobuf.Timestamp that names a real instant
    (years 1 to 9999, nanos below a second); items: a repeated or map field of at most `size`
    elements, each (each key, for a map) within `each`.
    """

    kind: Kind
    size: int
    required: bool = False
    each: Limit | None = None

    def describe(self) -> str:
        """The words the field's proto comment carries."""
        return "Limit: " + self._words() + "."

    def _words(self) -> str:
        if self.kind == "identifier":
            need = "required" if self.required else "optional"
            return f"identifier, 1-{self.size} of A-Z a-z 0-9 . _ : @ - ({need})"
        if self.kind == "text":
            return f"{self.size} characters, no NUL"
        if self.kind == "label":
            return f"{self.size} characters, no control characters"
        if self.kind == "token":
            return f"{self.size} printable ASCII characters"
        if self.kind == "integer":
            return f"0 to {self.size}"
        if self.kind == "struct":
            return f"{self.size} bytes encoded"
        if self.kind == "timestamp":
            return "a time in the years 1 to 9999"
        each = f", each {self.each._words()}" if self.each is not None else ""
        return f"{self.size} items{each}"

    def problem(self, path: str, value: Any) -> str | None:
        """What is wrong with `value` for this field, or None."""
        if self.kind == "integer":
            if not 0 <= value <= self.size:
                return f"{path} must be between 0 and {self.size}; got {value}"
            return None
        if self.kind == "struct":
            size = value.ByteSize()
            return (
                f"{path} is {size} bytes encoded; the limit is {self.size}"
                if size > self.size
                else None
            )
        if self.kind == "timestamp":
            in_range = _FIRST_SECOND <= value.seconds <= _LAST_SECOND
            if not (in_range and 0 <= value.nanos < 1_000_000_000):
                return f"{path} must be a time in the years 1 to 9999"
            return None
        if self.kind == "items":
            count = len(value)
            return (
                f"{path} has {count} items; the limit is {self.size}" if count > self.size else None
            )
        return self._string_problem(path, value)

    def _string_problem(self, path: str, value: str) -> str | None:
        if not value:
            return f"{path} is required" if self.required else None
        if self.kind == "identifier":
            if is_identifier(value, max_length=self.size):
                return None
            return (
                f"{path} must be 1-{self.size} characters of letters, digits and . _ : @ - "
                f"(starting with a letter or digit); got {value[:40]!r}"
            )
        if len(value) > self.size:
            return f"{path} is {len(value)} characters; the limit is {self.size}"
        if self.kind == "token" and not _TOKEN.fullmatch(value):
            return f"{path} must be printable ASCII (no spaces or control characters)"
        if self.kind == "label" and _CONTROL.search(value):
            return f"{path} must not contain control characters; got {value[:40]!r}"
        if _NOT_UNICODE.search(value):
            return f"{path} must be Unicode text without NUL characters"
        return None


# What datetime can hold: 0001-01-01T00:00:00Z and 9999-12-31T23:59:59Z as Unix seconds.
_FIRST_SECOND, _LAST_SECOND = -62_135_596_800, 253_402_300_799


def identifier(*, required: bool = False) -> Limit:
    """An identifier field (`tether.ids.is_identifier`)."""
    return Limit("identifier", ID_CHARS, required=required)


def text(size: int) -> Limit:
    """Free text: anything but NUL, up to `size` characters."""
    return Limit("text", size)


def token(size: int) -> Limit:
    """An opaque or enumerated word: printable ASCII, up to `size` characters."""
    return Limit("token", size)


RUN_ID = identifier(required=True)

# An agent document, in bytes: tether.agent_spec refuses a larger one before parsing it.
AGENT_DOCUMENT_BYTES = 256 * 1024

# "<message full name>.<field>" -> its limit. Bool and enum fields need none (every value of a
# bool is fine; an enum is checked against its declared numbers); a message field without an
# entry is checked field by field.
LIMITS: Mapping[str, Limit] = {
    # Admission's inputs (a gateway request carries them; admission checks them again).
    "tether.v1.Caller.tenant_id": identifier(required=True),
    "tether.v1.Caller.principal_id": identifier(required=True),
    "tether.v1.ChatInput.event_id": identifier(required=True),
    "tether.v1.ChatInput.conversation_id": identifier(required=True),
    "tether.v1.ChatInput.text": text(TEXT_CHARS),
    "tether.v1.ChatInput.channel": identifier(),
    "tether.v1.ChatInput.tenant_id": identifier(),
    "tether.v1.ChatInput.priority": token(6),
    "tether.v1.MessagingWebhookInput.provider": identifier(required=True),
    "tether.v1.MessagingWebhookInput.provider_event_id": identifier(required=True),
    "tether.v1.MessagingWebhookInput.thread_id": identifier(required=True),
    "tether.v1.MessagingWebhookInput.sender_id": identifier(required=True),
    "tether.v1.MessagingWebhookInput.sender_type": identifier(),
    "tether.v1.MessagingWebhookInput.text": text(TEXT_CHARS),
    "tether.v1.MessagingWebhookInput.tenant_id": identifier(),
    "tether.v1.ChannelMessageInput.channel_id": identifier(required=True),
    "tether.v1.ChannelMessageInput.event_id": identifier(required=True),
    "tether.v1.ChannelMessageInput.thread_id": identifier(required=True),
    "tether.v1.ChannelMessageInput.sender_id": identifier(required=True),
    "tether.v1.ChannelMessageInput.text": text(TEXT_CHARS),
    "tether.v1.ChannelMessageInput.agent": identifier(),
    "tether.v1.ReplyTarget.channel_id": identifier(required=True),
    "tether.v1.ReplyTarget.kind": identifier(required=True),
    "tether.v1.ReplyTarget.address": identifier(required=True),
    "tether.v1.ReplyTarget.thread": identifier(),
    "tether.v1.ReplyTarget.reply_to": token(256),
    "tether.v1.TaskStatusInput.task_id": identifier(required=True),
    "tether.v1.TaskStatusInput.status_event_id": identifier(required=True),
    "tether.v1.TaskStatusInput.status": identifier(required=True),
    "tether.v1.TaskStatusInput.detail": text(TEXT_CHARS),
    "tether.v1.TaskStatusInput.tenant_id": identifier(),
    "tether.v1.DecisionInput.decision_id": identifier(required=True),
    "tether.v1.DecisionInput.conversation_id": identifier(required=True),
    "tether.v1.DecisionInput.decision": text(4000),
    "tether.v1.DecisionInput.note": text(TEXT_CHARS),
    "tether.v1.DecisionInput.tenant_id": identifier(),
    # The gateway's requests.
    "tether.v1.SendMessageRequest.event_id": identifier(required=True),
    "tether.v1.SendMessageRequest.conversation_id": identifier(required=True),
    "tether.v1.SendMessageRequest.text": text(TEXT_CHARS),
    "tether.v1.SendMessageRequest.channel": identifier(),
    "tether.v1.SendMessageRequest.tenant_id": identifier(),
    "tether.v1.SendMessageRequest.priority": token(6),
    "tether.v1.GetRunRequest.run_id": RUN_ID,
    "tether.v1.ListRunsRequest.statuses": Limit("items", 16),
    "tether.v1.ListRunsRequest.conversation_id": identifier(),
    "tether.v1.ListRunsRequest.page_size": Limit("integer", INT32_MAX),
    "tether.v1.ListRunsRequest.page_token": token(512),
    "tether.v1.ListRunsRequest.created_after": Limit("timestamp", 0),
    "tether.v1.ListRunsRequest.tree_root_run_id": identifier(),
    "tether.v1.GetRunAttemptsRequest.run_id": RUN_ID,
    "tether.v1.RetryRunRequest.run_id": RUN_ID,
    "tether.v1.DeleteTenantRequest.tenant_id": identifier(required=True),
    "tether.v1.SetTenantRequest.tenant_id": identifier(required=True),
    "tether.v1.SetTenantRequest.weight": Limit("integer", 1000),
    "tether.v1.SetTenantRequest.max_running": Limit("integer", 100000),
    "tether.v1.CancelRunRequest.run_id": RUN_ID,
    "tether.v1.CancelRunRequest.reason": text(1000),
    "tether.v1.StreamRunRequest.run_id": RUN_ID,
    "tether.v1.StreamRunRequest.after_seq": Limit("integer", INT64_MAX),
    "tether.v1.StreamRunsRequest.statuses": Limit("items", 16),
    "tether.v1.StreamRunsRequest.conversation_id": identifier(),
    "tether.v1.StreamRunsRequest.page_size": Limit("integer", INT32_MAX),
    "tether.v1.StreamConversationRequest.conversation_id": identifier(required=True),
    "tether.v1.StreamConversationRequest.cursor": token(65_536),
    "tether.v1.GetPendingQuestionRequest.run_id": RUN_ID,
    "tether.v1.AnswerQuestionRequest.run_id": RUN_ID,
    "tether.v1.AnswerQuestionRequest.answers": Limit("items", 64, each=Limit("label", 128)),
    "tether.v1.QuestionAnswer.values": Limit("items", 64, each=text(4000)),
    "tether.v1.GetPendingApprovalRequest.run_id": RUN_ID,
    "tether.v1.DecideApprovalRequest.run_id": RUN_ID,
    "tether.v1.DecideApprovalRequest.decision": token(32),
    "tether.v1.DecideApprovalRequest.always_scope": token(32),
    "tether.v1.GetPendingConnectionRequest.run_id": RUN_ID,
    "tether.v1.CompleteConnectionRequest.run_id": RUN_ID,
    "tether.v1.CompleteConnectionRequest.state": token(512),
    "tether.v1.CompleteConnectionRequest.code": token(2048),
    # Empty for a tenant's key (its own tenant); the operator names one.
    "tether.v1.CreateApiKeyRequest.tenant_id": identifier(),
    "tether.v1.CreateApiKeyRequest.principal_id": identifier(required=True),
    "tether.v1.CreateApiKeyRequest.scopes": Limit("items", 16, each=token(64)),
    "tether.v1.CreateApiKeyRequest.labels": Limit("struct", 4096),
    "tether.v1.CreateApiKeyRequest.expires_at": Limit("timestamp", 0),
    "tether.v1.RevokeApiKeyRequest.key_id": identifier(required=True),
    "tether.v1.AddDocumentRequest.title": Limit("label", DOCUMENT_TITLE_CHARS, required=True),
    "tether.v1.AddDocumentRequest.content": Limit("text", DOCUMENT_CHARS, required=True),
    "tether.v1.ListDocumentsRequest.page_size": Limit("integer", INT32_MAX),
    "tether.v1.ListDocumentsRequest.page_token": token(512),
    "tether.v1.RemoveDocumentRequest.document_id": identifier(required=True),
    # A provider's token or signing secret is far shorter; the store refuses past 64 KiB of UTF-8.
    "tether.v1.AddSecretRequest.name": identifier(required=True),
    "tether.v1.AddSecretRequest.value": Limit("text", SECRET_CHARS, required=True),
    "tether.v1.RemoveSecretRequest.name": identifier(required=True),
    # Channel connections: a URL or JSON pointer is far shorter than 2048 characters.
    "tether.v1.AddChannelRequest.kind": identifier(required=True),
    "tether.v1.AddChannelRequest.name": identifier(required=True),
    "tether.v1.AddChannelRequest.agent": identifier(),
    "tether.v1.AddChannelRequest.api_base_url": text(CHANNEL_SETTING_CHARS),
    "tether.v1.AddChannelRequest.reply_url": text(CHANNEL_SETTING_CHARS),
    **{
        f"tether.v1.ChannelSecrets.{name}": text(SECRET_CHARS)
        for name in (
            "signing_secret",
            "bot_token",
            "app_secret",
            "verify_token",
            "access_token",
            "secret",
        )
    },
    "tether.v1.ChannelSettings.phone_number_id": identifier(),
    **{
        f"tether.v1.ChannelSettings.{name}": text(CHANNEL_SETTING_CHARS)
        for name in ("text_field", "thread_field", "sender_field", "event_id_field")
    },
    "tether.v1.GetChannelRequest.channel_id": identifier(required=True),
    "tether.v1.RemoveChannelRequest.channel_id": identifier(required=True),
    "tether.v1.RotateChannelSecretRequest.channel_id": identifier(required=True),
    "tether.v1.RotateChannelSecretRequest.secret": text(SECRET_CHARS),
    "tether.v1.RotateChannelSecretRequest.grace_seconds": Limit("integer", INT32_MAX),
    # Run-event webhooks: a URL as a channel's; a dozen event types exist; a Standard Webhooks
    # secret is under a hundred characters, refused by interactions past 1024.
    "tether.v1.AddWebhookRequest.url": text(CHANNEL_SETTING_CHARS),
    "tether.v1.AddWebhookRequest.events": Limit("items", 32, each=Limit("label", 64)),
    "tether.v1.AddWebhookRequest.secret": text(1024),
    "tether.v1.RemoveWebhookRequest.subscription_id": identifier(required=True),
    "tether.v1.ListWebhookDeliveriesRequest.subscription_id": identifier(required=True),
    "tether.v1.ListWebhookDeliveriesRequest.page_size": Limit("integer", INT32_MAX),
    "tether.v1.RedeliverWebhookRequest.delivery_id": identifier(required=True),
    # An agent document is refused past 256 KiB before it is parsed (tether.agent_spec).
    "tether.v1.ApplyAgentRequest.spec": Limit("text", AGENT_DOCUMENT_BYTES, required=True),
    "tether.v1.ApplyAgentRequest.base_version": Limit("integer", INT32_MAX),
    "tether.v1.GetAgentRequest.name": identifier(required=True),
    "tether.v1.GetAgentRequest.version": Limit("integer", INT32_MAX),
    "tether.v1.ListAgentVersionsRequest.name": identifier(required=True),
    "tether.v1.RollbackAgentRequest.name": identifier(required=True),
    "tether.v1.RollbackAgentRequest.to_version": Limit("integer", INT32_MAX),
    "tether.v1.RollbackAgentRequest.base_version": Limit("integer", INT32_MAX),
    "tether.v1.SetDefaultAgentRequest.name": identifier(required=True),
    "tether.v1.RemoveAgentRequest.name": identifier(required=True),
    "tether.v1.RenderAgentRequest.name": identifier(required=True),
    "tether.v1.RenderAgentRequest.message": text(TEXT_CHARS),
    "tether.v1.RenderAgentRequest.source": identifier(),
    "tether.v1.RenderAgentRequest.channel": identifier(),
    "tether.v1.RenderAgentRequest.version": Limit("integer", INT32_MAX),
    # Schedules: a cron is five short fields; an IANA zone name is under 40 characters; a
    # policy is a word; the catch-up window is at most 7 days (services.admission.cron).
    "tether.v1.AddScheduleRequest.agent": identifier(required=True),
    "tether.v1.AddScheduleRequest.cron": Limit("label", 256),
    "tether.v1.AddScheduleRequest.timezone": Limit("label", 64),
    "tether.v1.AddScheduleRequest.message": text(TEXT_CHARS),
    "tether.v1.AddScheduleRequest.overlap": Limit("label", 16),
    "tether.v1.AddScheduleRequest.catch_up": Limit("label", 16),
    "tether.v1.AddScheduleRequest.catch_up_window_seconds": Limit("integer", 7 * 86_400),
    "tether.v1.PauseScheduleRequest.schedule_id": identifier(required=True),
    "tether.v1.ResumeScheduleRequest.schedule_id": identifier(required=True),
    "tether.v1.RemoveScheduleRequest.schedule_id": identifier(required=True),
}


# Descriptors are typed Any below: protobuf's stubs type them as two unrelated classes (the
# Python and the upb implementation).
def limit_of(descriptor: Any, field: Any) -> Limit:
    """The documented limit of a field; a field without one is a bug in this table."""
    name = f"{descriptor.full_name}.{field.name}"
    try:
        return LIMITS[name]
    except KeyError:
        raise KeyError(f"{name} has no documented limit; add it to tether.limits.LIMITS") from None


def check_request(message: Message) -> None:
    """Refuse a request any of whose fields is outside its limit (INVALID_ARGUMENT, naming it)."""
    found = _problem(message, "")
    if found is not None:
        path, problem = found
        raise InvalidArgument(problem, details={"field": path})


def _problem(message: Message, prefix: str) -> tuple[str, str] | None:
    for field in message.DESCRIPTOR.fields:
        if field.type == FieldDescriptor.TYPE_BOOL:
            continue
        path = prefix + field.name
        value = getattr(message, field.name)
        if field.type == FieldDescriptor.TYPE_MESSAGE and not _is_repeated(field):
            limit = LIMITS.get(f"{message.DESCRIPTOR.full_name}.{field.name}")
            if limit is not None:
                found = _found(path, limit.problem(path, value))
            else:
                found = _problem(value, path + ".") if message.HasField(field.name) else None
        elif field.type == FieldDescriptor.TYPE_ENUM and not _is_repeated(field):
            found = _found(path, _enum_problem(field, path, value))
        else:
            found = _field_problem(message.DESCRIPTOR, field, path, value)
        if found is not None:
            return found
    return None


def _field_problem(descriptor: Any, field: Any, path: str, value: Any) -> tuple[str, str] | None:
    limit = limit_of(descriptor, field)
    if not _is_repeated(field):
        return _found(path, limit.problem(path, value))
    if (problem := limit.problem(path, value)) is not None:
        return path, problem
    entry = field.message_type
    if entry is not None and entry.GetOptions().map_entry:
        value_field = entry.fields_by_name["value"]
        for key in value:
            where = f"{path}[{key!r}]"
            if limit.each is not None and (problem := limit.each.problem(f"{path} key", key)):
                return where, problem
            nested = value_field.type == FieldDescriptor.TYPE_MESSAGE
            if nested and (found := _problem(value[key], where + ".")) is not None:
                return found
        return None
    for i, item in enumerate(value):
        where = f"{path}[{i}]"
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            found = _problem(item, where + ".")
        elif field.type == FieldDescriptor.TYPE_ENUM:
            found = _found(where, _enum_problem(field, where, item))
        else:
            each = limit.each
            found = _found(where, each.problem(where, item) if each is not None else None)
        if found is not None:
            return found
    return None


def _enum_problem(field: Any, path: str, value: int) -> str | None:
    enum = field.enum_type
    if value in enum.values_by_number:
        return None
    known = ", ".join(v.name for v in enum.values)
    return f"{path} has no value {value}; known values are {known}"


def _found(path: str, problem: str | None) -> tuple[str, str] | None:
    return None if problem is None else (path, problem)


def _is_repeated(field: Any) -> bool:
    return bool(field.is_repeated)
