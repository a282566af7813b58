"""The tool catalog's pure parts: the hello's announcements on the wire (a round trip, and what
the orchestrator refuses), a schema's digest, and which tools and models a document names."""

from __future__ import annotations

import json

import pytest

from tether import agent_spec
from tether.convert.catalog import (
    MAX_ANNOUNCED_TOOLS,
    announcements_from_proto,
    announcements_to_proto,
)
from tether.domain import ToolAnnouncement, schema_sha256
from tether.errors import InvalidArgument
from tether.v1 import orchestrator_pb2

DIGEST = schema_sha256({"type": "object"})


def test_announcements_survive_the_wire() -> None:
    sent = [
        ToolAnnouncement("get_time", DIGEST, "read", False),
        ToolAnnouncement("publish_post", "0" * 64, "publish", True),
    ]
    assert announcements_from_proto(announcements_to_proto(sent)) == sent


@pytest.mark.parametrize(
    ("tools", "named"),
    [
        ([("a b", DIGEST, "read")], r"tools\[0\]\.name"),
        ([("ok", DIGEST, "read"), ("ok", DIGEST, "read")], r"tools\[1\]: .*'ok' .*twice"),
        ([("ok", DIGEST.upper(), "read")], r"tools\[0\]\.input_schema_sha256"),
        ([("ok", "abc", "read")], r"tools\[0\]\.input_schema_sha256"),
        ([("ok", DIGEST, "")], r"tools\[0\]\.risk"),
        ([("ok", DIGEST, "r" * 65)], r"tools\[0\]\.risk"),
    ],
)
def test_an_announcement_a_catalog_cannot_hold_is_refused_naming_it(
    tools: list[tuple[str, str, str]], named: str
) -> None:
    wire = [
        orchestrator_pb2.ToolAnnouncement(name=n, input_schema_sha256=d, risk=r)
        for n, d, r in tools
    ]
    with pytest.raises(InvalidArgument, match=named):
        announcements_from_proto(wire)


def test_a_hello_announces_at_most_so_many_tools() -> None:
    wire = [
        orchestrator_pb2.ToolAnnouncement(name=f"t{i}", input_schema_sha256=DIGEST, risk="read")
        for i in range(MAX_ANNOUNCED_TOOLS + 1)
    ]
    with pytest.raises(InvalidArgument, match=f"at most {MAX_ANNOUNCED_TOOLS}"):
        announcements_from_proto(wire)
    assert len(announcements_from_proto(wire[:MAX_ANNOUNCED_TOOLS])) == MAX_ANNOUNCED_TOOLS


def test_a_schemas_digest_ignores_key_order_and_sees_any_change() -> None:
    one = {"type": "object", "properties": {"a": {"type": "string"}}}
    same = {"properties": {"a": {"type": "string"}}, "type": "object"}
    other = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert schema_sha256(one) == schema_sha256(same) != schema_sha256(other)
    assert len(schema_sha256(one)) == 64


def test_every_tool_a_document_names_is_found_at_its_pointer() -> None:
    bundle = {"version": 1, "instructions": "Do."}
    spec = agent_spec.parse(
        json.dumps(
            {
                "name": "a",
                "persona": {**bundle, "name": "p", "tools": ["p1"]},
                "personas": [{**bundle, "name": "q", "tools": ["q1", "q2"]}],
                "skills": [{**bundle, "name": "s", "tools": ["s1"]}],
                "tools": ["t1"],
            }
        )
    )
    assert list(agent_spec.tool_references(spec)) == [
        ("/tools/0", "t1"),
        ("/persona/tools/0", "p1"),
        ("/personas/0/tools/0", "q1"),
        ("/personas/0/tools/1", "q2"),
        ("/skills/0/tools/0", "s1"),
    ]


def test_only_a_model_without_any_price_is_a_violation() -> None:
    price = {"input": 1, "output": 1, "cache_write": 1, "cache_read": 1}
    priced = agent_spec.parse(json.dumps({"name": "a", "model": "x-1", "prices": {"x-1": price}}))
    assert list(agent_spec.unpriced_models(priced)) == []
    default = agent_spec.parse(json.dumps({"name": "a"}))
    assert list(agent_spec.unpriced_models(default)) == []
    booked = agent_spec.parse(json.dumps({"name": "a", "model": "claude-opus-5"}))
    assert list(agent_spec.unpriced_models(booked)) == []
    unpriced = agent_spec.parse(json.dumps({"name": "a", "model": "x-2", "prices": {"x-1": price}}))
    assert [v.pointer for v in agent_spec.unpriced_models(unpriced)] == ["/model"]
