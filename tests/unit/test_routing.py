"""Routing as explicit data: the persona and skills a run gets by its source and channel, the
tool allowlist that follows, and the stored form a run is pinned to."""

from __future__ import annotations

from typing import Any

import pytest

from services.orchestrator import routing
from tether.convert.configs import config_from_proto, config_to_proto, routing_to_proto
from tether.domain import AgentConfig, Bundle, RunRouting
from tether.errors import InvalidArgument

CONCIERGE = {
    "name": "concierge",
    "version": 2,
    "instructions": "You look after guests on WhatsApp.",
    "tools": ["get_time"],
    "channels": ["whatsapp"],
}
CALENDAR = {
    "name": "calendar",
    "version": 3,
    "instructions": "You read the user's calendar when asked about their day.",
    "tools": ["calendar_list_events"],
    "sources": ["chat"],
}
REFUNDS = {
    "name": "refunds",
    "version": 1,
    "instructions": "You explain the refund policy.",
    "tools": ["request_approval"],
}
AGENT: dict[str, Any] = {
    "persona": {"name": "helper", "version": 5, "instructions": "You are a helper."},
    "personas": [CONCIERGE],
    "skills": [CALENDAR, REFUNDS],
    "tool_allowlist": ["ask_questions"],
}


def test_a_tenant_without_configuration_gets_the_builtin_persona_and_no_skills() -> None:
    config = routing.resolve({}, "chat", "chat")
    assert config.persona == routing.BUILTIN_PERSONA
    assert config.skills == ()
    assert [b.text for b in config.system_blocks] == [routing.DEFAULT_PERSONA]
    assert config.tool_allowlist == routing.DEFAULT.tool_allowlist
    assert config.context.live_facts == ("channel", "actor", "time")


def test_persona_and_skills_are_picked_by_source_and_channel() -> None:
    chat = routing.resolve(AGENT, "chat", "chat")
    assert chat.persona is not None and chat.persona.ref == "helper@5"
    assert [s.ref for s in chat.skills] == ["calendar@3", "refunds@1"]
    assert [b.text for b in chat.system_blocks] == [
        "You are a helper.",
        CALENDAR["instructions"],
        REFUNDS["instructions"],
    ]
    # One cache breakpoint, on the last block of the stable prefix.
    assert [b.cache_control for b in chat.system_blocks] == ["", "", "ephemeral"]
    assert chat.tool_allowlist == ("ask_questions", "calendar_list_events", "request_approval")

    guest = routing.resolve(AGENT, "messaging", "whatsapp")
    assert guest.persona is not None and guest.persona.ref == "concierge@2"
    assert [s.ref for s in guest.skills] == ["refunds@1"]  # calendar is for chat only
    assert guest.tool_allowlist == ("ask_questions", "get_time", "request_approval")
    assert guest.system_prompt == (
        "You look after guests on WhatsApp.\n\nYou explain the refund policy."
    )


def test_a_persona_configured_as_a_system_prompt_before_personas_still_applies() -> None:
    config = routing.resolve({"system_prompt": "Be terse."}, "chat", "chat")
    assert config.persona == Bundle("custom", 1, "Be terse.")
    assert config.system_prompt == "Be terse."


@pytest.mark.parametrize(
    ("agent", "says"),
    [
        ({"skills": [{"name": "x", "version": 1}]}, "skills[0].instructions"),
        ({"skills": [{**REFUNDS, "version": 0}]}, "skills[0].version"),
        ({"skills": [{**REFUNDS, "name": "no spaces"}]}, "skills[0].name"),
        ({"skills": [REFUNDS, REFUNDS]}, "names a bundle twice"),
        ({"skills": "refunds"}, "skills must be a list"),
        ({"personas": [{**CONCIERGE, "colour": "red"}]}, "unknown field(s) colour"),
        ({"persona": {**CONCIERGE, "tools": ["bad tool"]}}, "persona.tools"),
        ({"context": {"timezone": "Mars/Olympus"}}, "not a known time zone"),
        ({"context": {"budget_tokens": -1}}, "context.budget_tokens"),
        ({"context": {"cache_ttl": "2h"}}, "context.cache_ttl"),
        ({"context": {"no_such": 1}}, "invalid"),
        ({"skills": [{**REFUNDS, "instructions": "x" * 32_001}]}, "the limit is 32000"),
    ],
)
def test_a_broken_configuration_is_refused_naming_what_is_wrong(
    agent: dict[str, Any], says: str
) -> None:
    with pytest.raises(InvalidArgument) as refused:
        routing.resolve(agent, "chat", "chat")
    assert says in refused.value.message


def test_the_stored_form_and_the_wire_form_carry_the_whole_decision() -> None:
    config = routing.resolve(
        {**AGENT, "context": {"budget_tokens": 9000, "timezone": "Europe/Paris"}}, "chat", "chat"
    )
    assert AgentConfig.from_json(config.to_json()) == config
    assert config_from_proto(config_to_proto(config)) == config
    shown = routing_to_proto(RunRouting("r1", config.to_json()))
    assert (shown.persona.name, shown.persona.version) == ("helper", 5)
    assert [(s.name, s.version) for s in shown.skills] == [("calendar", 3), ("refunds", 1)]
    assert list(shown.tool_allowlist) == list(config.tool_allowlist)


def test_a_decision_stored_before_personas_reads_back_without_them() -> None:
    stored = routing.DEFAULT.to_json()
    for key in ("persona", "skills", "context"):
        stored.pop(key)
    config = AgentConfig.from_json(stored)
    assert config.persona is None and config.skills == ()
    assert config.context.live_facts == () and config.context.retriever == ""
