"""Field limits: every field of a public request has one, the proto comment states it, and the
one check refuses what lies outside it, naming the field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from tether.errors import InvalidArgument
from tether.ids import is_identifier
from tether.limits import LIMITS, check_request
from tether.v1 import admission_pb2, gateway_pb2, interactions_pb2

PROTOS = Path(__file__).resolve().parents[2] / "protos" / "tether" / "v1"
_FIELD = re.compile(r"^\s*(?:repeated\s+|optional\s+)?(?:map<[^>]+>|[\w.]+)\s+(\w+)\s*=\s*\d+")


@pytest.mark.parametrize("value", ["abc\n", "abc\r", "abc\x00", "a\tb", "\nabc", "abc ", ""])
def test_an_identifier_has_no_control_characters_or_trailing_newline(value: str) -> None:
    assert not is_identifier(value)


def test_an_identifier_is_letters_digits_and_a_few_marks() -> None:
    assert is_identifier("run_0193c1d2e3f4:x@y.z-1")
    assert not is_identifier("x" * 129)


def _public_requests() -> list[Descriptor]:
    service = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"]
    return [m.input_type for m in service.methods] + [admission_pb2.AdmitRequest.DESCRIPTOR]


def _fields_needing_a_limit(descriptor: Descriptor, seen: set[str]) -> list[str]:
    if descriptor.full_name in seen or descriptor.full_name.startswith("google.protobuf."):
        return []
    seen.add(descriptor.full_name)
    out = []
    for field in descriptor.fields:
        name = f"{descriptor.full_name}.{field.name}"
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            out.append(name)
            value = entry.fields_by_name["value"].message_type
            if value is not None:
                out += _fields_needing_a_limit(value, seen)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            if name in LIMITS or field.is_repeated:
                out.append(name)
            out += _fields_needing_a_limit(field.message_type, seen)
        elif field.type == FieldDescriptor.TYPE_ENUM:
            if field.is_repeated:
                out.append(name)
        elif field.type != FieldDescriptor.TYPE_BOOL:
            out.append(name)
    return out


def _proto_comments() -> dict[str, str]:
    """'tether.v1.Message.field' -> the comment above the field, from the .proto sources."""
    comments: dict[str, str] = {}
    for path in PROTOS.glob("*.proto"):
        stack: list[str | None] = []
        comment: list[str] = []
        for line in path.read_text().splitlines():
            stripped = line.strip()
            if match := re.match(r"message\s+(\w+)\s*\{", stripped):
                stack.append(match.group(1))
            elif re.match(r"oneof\s+\w+\s*\{", stripped):
                stack.append(None)
            elif stripped.startswith("}") and stack:
                stack.pop()
            elif stripped.startswith("//"):
                comment.append(stripped.removeprefix("//").strip())
                continue
            elif (field := _FIELD.match(line)) and any(stack):
                message = [name for name in stack if name][-1]
                comments[f"tether.v1.{message}.{field.group(1)}"] = " ".join(comment)
            comment = []
    return comments


def test_every_field_of_every_public_request_has_a_limit() -> None:
    seen: set[str] = set()
    needed = [f for d in _public_requests() for f in _fields_needing_a_limit(d, seen)]
    assert len(needed) > 40
    assert [name for name in needed if name not in LIMITS] == []
    assert sorted(set(LIMITS) - set(needed)) == []


def test_every_limit_is_written_in_its_proto_comment() -> None:
    comments = _proto_comments()
    wrong = {
        name: comments.get(name)
        for name, limit in LIMITS.items()
        if limit.describe() not in comments.get(name, "")
    }
    assert wrong == {}


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (
            gateway_pb2.SendMessageRequest(event_id="e", conversation_id="c\n", text="x"),
            "conversation_id",
        ),
        (gateway_pb2.SendMessageRequest(event_id="e", conversation_id="c", text="a\x00b"), "text"),
        (
            gateway_pb2.SendMessageRequest(event_id="e", conversation_id="c", text="x" * 32_001),
            "text",
        ),
        (gateway_pb2.SendMessageRequest(conversation_id="c", text="x"), "event_id"),
        (gateway_pb2.GetRunRequest(run_id=""), "run_id"),
        (gateway_pb2.ListRunsRequest(statuses=[42]), "statuses[0]"),  # type: ignore[list-item]
        (gateway_pb2.ListRunsRequest(page_size=-1), "page_size"),
        (gateway_pb2.ListRunsRequest(page_token="a b"), "page_token"),
        (gateway_pb2.CancelRunRequest(run_id="r", reason="x" * 1001), "reason"),
        (gateway_pb2.StreamRunRequest(run_id="r", after_seq=-5), "after_seq"),
        (
            gateway_pb2.AnswerQuestionRequest(
                run_id="r", answers={"k": interactions_pb2.QuestionAnswer(values=["\x00"])}
            ),
            "answers['k'].values[0]",
        ),
        (
            gateway_pb2.AnswerQuestionRequest(
                run_id="r", answers={"k\n": interactions_pb2.QuestionAnswer(values=["a"])}
            ),
            "answers['k\\n']",
        ),
        (
            gateway_pb2.CreateApiKeyRequest(tenant_id="t", principal_id="p", scopes=["a"] * 17),
            "scopes",
        ),
        (
            gateway_pb2.SubmitEventRequest(
                task_status=admission_pb2.TaskStatusInput(
                    task_id="t", status_event_id="s", status="done", detail="\x00"
                )
            ),
            "task_status.detail",
        ),
    ],
)
def test_a_field_outside_its_limit_is_refused_by_name(request_: object, field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        check_request(request_)  # type: ignore[arg-type]
    assert info.value.details == {"field": field}
    assert field.split("[")[0].split(".")[-1] in info.value.message


def test_a_request_within_every_limit_passes() -> None:
    check_request(
        gateway_pb2.SendMessageRequest(event_id="e-1", conversation_id="c", text="hi\n\tthere")
    )
    check_request(
        gateway_pb2.AnswerQuestionRequest(
            run_id="run_1", answers={"dinner": interactions_pb2.QuestionAnswer(values=["Soup"])}
        )
    )
