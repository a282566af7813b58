"""What the Work stream's codec builds once instead of per run: a routing's config
message, and the stage durations read straight off their message."""

from __future__ import annotations

from google.protobuf import json_format

from tether.convert import work
from tether.convert.configs import config_to_proto
from tether.convert.work import MAX_CONFIG_MESSAGES, STAGES, config_message
from tether.domain import AgentConfig
from tether.domain.agents import Limits, SystemBlock
from tether.v1 import orchestrator_pb2


def _config(model: str) -> AgentConfig:
    return AgentConfig(
        model=model,
        agent="support",
        system_prompt="Be brief.",
        system_blocks=(SystemBlock("Be brief.", "ephemeral"),),
        tool_allowlist=("get_time",),
        limits=Limits(max_attempts=2),
    )


def test_a_routings_config_message_is_built_once_and_is_what_config_to_proto_builds() -> None:
    one, other = _config("m-1"), _config("m-2")
    first = config_message(one)
    assert first == config_to_proto(one)
    assert config_message(one) is first
    assert config_message(other) == config_to_proto(other)
    # An equal config that is another object (a routing read back from the database) gets a
    # message of its own, equal to the first.
    again = _config("m-1")
    assert config_message(again) is not first
    assert config_message(again) == first


def test_the_config_messages_kept_are_bounded() -> None:
    for n in range(MAX_CONFIG_MESSAGES + 5):
        config_message(_config(f"m-{n}"))
    assert len(work._CONFIG_MESSAGES) <= MAX_CONFIG_MESSAGES


def test_stage_durations_read_as_message_to_dict_reads_them() -> None:
    for stages in (
        orchestrator_pb2.StageDurations(),
        orchestrator_pb2.StageDurations(context_ms=2.5, attempt_ms=18.25, total_ms=21.0),
    ):
        assert {n: getattr(stages, n) for n in STAGES} == json_format.MessageToDict(
            stages, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
