"""`tether.domain.camel` spells every field name as protobuf's JSON mapping does, so the JSON the
orchestrator builds by hand (event payloads, stored parts) reads back through json_format."""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor

from tether.domain import camel, camel_keys
from tether.v1 import common_pb2, events_pb2, orchestrator_pb2


def all_fields(descriptor: Descriptor, seen: set[str]) -> list[tuple[str, str]]:
    if descriptor.full_name in seen:
        return []
    seen.add(descriptor.full_name)
    out = []
    for field in descriptor.fields:
        out.append((field.name, field.json_name))
        if field.message_type is not None:
            out.extend(all_fields(field.message_type, seen))
    return out


def test_camel_matches_protobuf_on_every_field_of_the_stored_messages() -> None:
    seen: set[str] = set()
    fields = [
        *all_fields(common_pb2.Part.DESCRIPTOR, seen),
        *all_fields(events_pb2.RunEvent.DESCRIPTOR, seen),
        *all_fields(orchestrator_pb2.CheckpointRequest.DESCRIPTOR, seen),
    ]
    assert len(fields) > 50
    assert {name: camel(name) for name, _ in fields} == dict(fields)


def test_camel_keys_renames_keys_only() -> None:
    assert camel_keys({"retry_after_ms": 1, "code": {"a_b": 2}}) == {
        "retryAfterMs": 1,
        "code": {"a_b": 2},
    }
