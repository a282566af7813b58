"""The `delegate` tool's input check, the words a child's end becomes, the document's
`delegation` through routing and the wire, and the calls a lost lease leaves open."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.orchestrator.routing import resolve
from services.worker.delegation import (
    DELEGATE,
    Child,
    DelegateRefused,
    child_result,
    delegate_input,
    delegate_specs,
)
from tether.agent_spec import parse
from tether.convert.configs import config_from_proto, config_to_proto
from tether.domain import (
    AgentConfig,
    Delegation,
    Interruption,
    Part,
    Role,
    RunError,
    ToolCall,
    ToolResult,
    close_attempt,
)
from tether.domain.rules import REISSUED_CALLS
from tether.errors import InvalidArgument
from tether.states import RunStatus

ALLOWED = Delegation(("researcher", "writer"))


@pytest.mark.parametrize(
    ("input", "words"),
    [
        ({"message": "x"}, "give `agent`, one of: researcher, writer"),
        ({"agent": "stranger", "message": "x"}, "may not delegate to 'stranger'"),
        ({"agent": "writer"}, "give `message`"),
        ({"agent": "writer", "message": "   "}, "give `message`"),
        ({"agent": "writer", "message": "x" * 32_001}, "at most 32000 characters"),
    ],
)
def test_a_delegate_input_the_model_must_correct_says_how(
    input: dict[str, Any], words: str
) -> None:
    with pytest.raises(DelegateRefused, match=words.replace("`", ".").replace("(", ".")):
        delegate_input(input, ALLOWED)


def test_a_delegate_input_names_its_agent_and_message() -> None:
    assert delegate_input({"agent": "writer", "message": "draft it"}, ALLOWED) == (
        "writer",
        "draft it",
    )


def test_a_child_ends_as_its_answer_or_as_an_error_saying_why() -> None:
    done = Child("run_c", RunStatus.COMPLETED, "the answer", None, False)
    assert child_result(done) == ("the answer", False, "")
    failed = Child("run_c", RunStatus.FAILED, "", RunError("max_steps_exceeded", "too long"), True)
    assert child_result(failed) == ("the child run run_c failed: too long", True, "child_failed")
    cancelled = Child("run_c", RunStatus.CANCELLED, "", None, False)
    content, is_error, code = child_result(cancelled)
    assert is_error and code == "child_cancelled" and "cancelled" in content
    assert not Child("run_c", RunStatus.QUEUED, "", None, True).ended


def test_the_tool_is_offered_only_when_the_document_allows_delegation() -> None:
    assert delegate_specs(AgentConfig(model="m")) == []
    (spec,) = delegate_specs(AgentConfig(model="m", delegation=ALLOWED))
    assert spec["name"] == DELEGATE
    assert spec["input_schema"]["properties"]["agent"]["enum"] == ["researcher", "writer"]


def test_a_documents_delegation_reaches_the_worker_with_its_defaults() -> None:
    spec = parse('{"name": "lead", "delegation": {"agents": ["researcher"], "max_children": 2}}')
    config = resolve(spec.overrides())
    assert config.delegation == Delegation(("researcher",), max_depth=3, max_children=2)
    assert AgentConfig.from_json(config.to_json()) == config
    assert config_from_proto(config_to_proto(config)).delegation == config.delegation
    plain = resolve(parse('{"name": "solo"}').overrides())
    assert plain.delegation is None
    assert config_from_proto(config_to_proto(plain)).delegation is None
    assert "delegation" not in plain.to_json(), "a routing without it keeps its digest"


@pytest.mark.parametrize(
    "delegation",
    [
        {"agents": []},
        {"agents": ["a", "a"]},
        {"agents": ["a"], "max_depth": 0},
        {"agents": ["a"], "max_children": 65},
        {"agents": ["a"], "fan_out": 3},
        {"max_depth": 2},
    ],
)
def test_a_bad_delegation_is_refused_when_the_document_is_applied(
    delegation: dict[str, Any],
) -> None:
    with pytest.raises(InvalidArgument, match="delegation"):
        parse(json.dumps({"name": "lead", "delegation": delegation}))


def _call(index: int, call_id: str, name: str) -> Part:
    return Part(index, Role.ASSISTANT, ToolCall(call_id, name, {}), final=True)


def test_a_lost_lease_leaves_the_delegate_calls_open_for_the_next_attempt() -> None:
    parts = [_call(0, "toolu_d", DELEGATE), _call(1, "toolu_s", "slow_task")]
    kept = close_attempt(
        parts, 1, regenerated=True, interrupted=Interruption.LEASE_LOST, keep=REISSUED_CALLS
    )
    closed = [p.content for p in kept.parts]
    assert [c.tool_call_id for c in closed if isinstance(c, ToolResult)] == ["toolu_s"]
    ended = close_attempt(parts, 1, regenerated=False, interrupted=Interruption.RUN_CANCELLED)
    assert len(ended.parts) == 2, "a run that ends closes them all"
