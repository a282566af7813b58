"""The agent document (tether.agent_spec): what is accepted and how it is normalised, every way
a document is refused (with its pointer), YAML that cannot run or grow, the digest of an
identical apply, which agent takes a run, and the document read back as today's routing and
approval policy."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from services.orchestrator import routing
from tether import agent_spec
from tether.agent_spec import MAX_DOCUMENT_BYTES, AgentSpec, Route
from tether.domain import AgentConfig
from tether.errors import InvalidArgument

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "agents"
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
FULL: dict[str, Any] = {
    "name": "helper",
    "model": "claude-opus-5-5",
    "persona": {"name": "helper", "version": 5, "instructions": "You are a helper."},
    "personas": [CONCIERGE],
    "skills": [CALENDAR],
    "tools": ["ask_questions", "publish_post"],
    "context": {"budget_tokens": 9000, "timezone": "Europe/Paris", "cache_ttl": "1h"},
    "limits": {
        "max_steps": 12,
        "max_tool_calls": 20,
        "wall_clock_seconds": 120,
        "max_input_tokens": 500_000,
        "max_output_tokens": 50_000,
        "max_tokens_per_turn": 2048,
        "max_cost_usd": 0.123457,
        "max_attempts": 2,
        "backoff_initial_seconds": 1,
        "backoff_max_seconds": 4.5,
        "max_inline_tool_output_bytes": 8192,
    },
    "approvals": {
        "ttl_seconds": 7200,
        "always_allow_scopes": ["principal", "tenant"],
        "tools": {"publish_post": {"decisions": ["allow-once", "deny"], "ttl_seconds": 600}},
        "risks": {"send_reply": {"decisions": ["allow-once", "allow-always", "deny"]}},
    },
    "prices": {
        "claude-opus-5-5": {"input": 3, "output": 15.5, "cache_write": 4, "cache_read": 0.3}
    },
    "routes": [{"source": "chat", "channel": "web"}, {"source": "task"}],
}


def refused(document: str | bytes | dict[str, Any]) -> list[tuple[str, str]]:
    """The (pointer, message) pairs `parse` refuses `document` with; fails if it accepts it."""
    text = json.dumps(document) if isinstance(document, dict) else document
    with pytest.raises(InvalidArgument) as caught:
        agent_spec.parse(text)
    assert caught.value.status == grpc.StatusCode.INVALID_ARGUMENT
    found = [(v["pointer"], v["message"]) for v in caught.value.details["violations"]]
    for where, message in found:
        assert f"{where or '/'}: {message}" in caught.value.message
    return found


def test_a_full_document_is_accepted_and_normalised() -> None:
    written = json.dumps(FULL, indent=2)
    spec = agent_spec.parse(written)
    assert (spec.name, spec.written) == ("helper", written)
    doc = spec.normalised
    assert list(doc) == sorted(doc) and list(doc["limits"]) == sorted(doc["limits"])
    assert doc["limits"]["max_cost_usd"] == "0.123457"
    assert doc["limits"]["wall_clock_seconds"] == 120.0
    assert isinstance(doc["limits"]["max_steps"], int)
    assert doc["prices"]["claude-opus-5-5"]["input"] == 3.0
    assert json.loads(agent_spec.canonical_json(doc)) == doc
    assert spec.routes == (Route("chat", "web"), Route("task", ""))
    assert spec.approvals()["always_allow_scopes"] == ["principal", "tenant"]


def test_every_violation_is_reported_with_its_pointer_all_at_once() -> None:
    document = {
        "name": "bad name",
        "model": "",
        "instructions": "   ",
        "tools": ["get_time", 7],
        "context": {"timezone": "Mars/Olympus", "cache_ttl": "2h", "budget_tokens": -1},
        "limits": {"max_steps": 0, "max_cost_usd": 0.0000001, "wall_clock_seconds": "300"},
        "approvals": {
            "always_allow_scopes": ["planet"],
            "risks": {"read": {"decisions": ["allow-once"]}},
        },
        "prices": {"m": {"input": 1}},
        "routes": [{"source": "sms"}, {"channel": "whatsapp"}, {"channel": "whatsapp"}],
        "skills": [CALENDAR, CALENDAR],
    }
    reported = refused(document)
    found = dict(reported)
    assert len(found) == len(reported), "one violation per place"
    assert found == {
        "/name": found["/name"],
        "/model": "must not be empty",
        "/instructions": "must not be blank",
        "/tools/1": "must be text",
        "/context/timezone": "must be a known time zone (e.g. Europe/Paris)",
        "/context/cache_ttl": "must be one of 5m, 1h",
        "/context/budget_tokens": "must be >= 0",
        "/limits/max_steps": "must be >= 1",
        "/limits/max_cost_usd": "must be in whole micro-dollars (at most 6 decimal places)",
        "/limits/wall_clock_seconds": "must be a number",
        "/approvals/always_allow_scopes/0": "must be one of principal, tenant, category",
        "/approvals/risks/read": found["/approvals/risks/read"],
        "/approvals/risks/read/decisions": "must include deny",
        "/prices/m/output": "is required",
        "/prices/m/cache_write": "is required",
        "/prices/m/cache_read": "is required",
        "/routes/0/source": "must be one of chat, messaging, task, decision",
        "/routes/2": "repeats /routes/1",
        "/skills/1/name": "repeats /skills/0",
    }
    assert found["/name"].startswith("must be an identifier")
    assert found["/approvals/risks/read"].startswith("must be one of publish, schedule")


@pytest.mark.parametrize(
    ("document", "where"),
    [
        ({"name": "a", "max_concurrency": 3}, "/max_concurrency"),
        ({"name": "a", "limits": {"max_cost_micros": 5}}, "/limits/max_cost_micros"),
        ({"name": "a", "routes": [{"source": "chat", "priority": 1}]}, "/routes/0/priority"),
        ({"name": "a", "persona": {**CALENDAR, "style": "x"}}, "/persona/style"),
        (
            {"name": "a", "approvals": {"tools": {"x": {"timeout": 1}}}},
            "/approvals/tools/x/timeout",
        ),
    ],
)
def test_an_unknown_field_is_refused_where_it_is(document: dict[str, Any], where: str) -> None:
    [(pointer, message)] = refused(document)
    assert pointer == where and message.startswith("is not a known field")


def test_a_field_the_document_needs_is_named() -> None:
    assert refused({"model": "claude-opus-5-5"}) == [("/name", "is required")]
    assert refused("[1, 2]") == [("", "must be an object")]


def test_a_document_over_256_kib_is_refused_before_it_is_parsed() -> None:
    # Not JSON and not YAML either: only the size can be what is refused.
    over = b"{" + b"x" * MAX_DOCUMENT_BYTES
    assert refused(over) == [("", f"the document is {len(over)} bytes; the limit is 262144")]
    # Counted in bytes, not characters: 'é' is two.
    text = "name: a\n# " + "é" * (MAX_DOCUMENT_BYTES // 2)
    assert len(text) < MAX_DOCUMENT_BYTES
    [(_, message)] = refused(text)
    assert message.startswith("the document is ")
    at_limit = '{"name": "a"}'.ljust(MAX_DOCUMENT_BYTES)
    assert agent_spec.parse(at_limit.encode()).name == "a"
    [(_, message)] = refused((at_limit + " ").encode())
    assert message == f"the document is {MAX_DOCUMENT_BYTES + 1} bytes; the limit is 262144"


@pytest.mark.parametrize(
    "text",
    [
        "name: !!python/object/apply:os.system ['touch /tmp/as/pwned']",
        "!!python/object/new:os.system [touch /tmp/as/pwned]",
        "name: !!str a",
        "name: !custom a",
        "%TAG ! tag:example.com,2000:\n---\nname: !x a",
        "? !!python/tuple [a, b]\n: 1",
    ],
)
def test_yaml_tags_are_refused(text: str) -> None:
    [(pointer, message)] = refused(text)
    assert pointer == "" and "YAML tags are not accepted" in message
    assert not Path("/tmp/as/pwned").exists()


BILLION_LAUGHS = "\n".join(
    ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    + [
        f"{c}: &{c} [{','.join(['*' + p] * 9)}]"
        for p, c in zip("abcdefgh", "bcdefghi", strict=True)
    ]
    + ["name: x"]
)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (BILLION_LAUGHS, "YAML aliases are not accepted (line 2)"),
        (
            "tools: &t [get_time]\npersona: {name: a, version: 1, instructions: x, tools: *t}",
            "alias",
        ),
        ("base: &b {max_steps: 2}\nlimits:\n  <<: *b", "alias"),
        ("name: a\nlimits:\n  <<: {max_steps: 2}", "YAML merge keys are not accepted"),
        ("name: a\nname: b", "the key 'name' appears twice in one object"),
        ('{"name": "a", "name": "b"}', "the key 'name' appears twice in one object"),
        ("name: a\n---\nname: b", "neither JSON nor YAML"),
        ("name: [a", "neither JSON nor YAML"),
        ("[" * 100_000, "nests deeper than 16 levels"),
        ("a:\n" + "".join("  " * i + "- \n" for i in range(1, 40)), "nests deeper than 16"),
        ('{"name": "a", "limits": {"max_steps": NaN}}', "NaN is not a number"),
        ('{"name": "a", "limits": {"max_cost_usd": Infinity}}', "Infinity is not a number"),
        (b'{"name": "\xff"}', "not UTF-8 text"),
        ('{"name": "a", "limits": {"max_steps": 1' + "0" * 5000 + "}}", "unreadable value"),
    ],
)
def test_yaml_and_json_that_cannot_be_read_as_plain_data_are_refused(
    text: str | bytes, says: str
) -> None:
    [(pointer, message)] = refused(text)
    assert pointer == "" and says in message


@pytest.mark.parametrize(
    ("text", "where", "says"),
    [
        ('{"name": "a\\u0000b"}', "/name", "it holds a NUL character"),
        ('{"name": "a", "tools": ["x"], "model": "m\\u0000"}', "/model", "NUL"),
        ('{"name": "a", "limits": {"max\\u0000steps": 1}}', "/limits/max\x00steps", "its key"),
        ('{"name": "a", "instructions": "\\ud800"}', "/instructions", "lone surrogate"),
        ("name: a\nlimits: {max_steps: .inf}", "/limits/max_steps", "must be a finite number"),
        ("name: a\nmodel: 2024-01-01", "/model", "is a YAML date; quote it"),
        ("name: a\n1: x", "", "the key 1 is not text"),
    ],
)
def test_nul_bytes_and_values_json_cannot_hold_are_refused_where_they_are(
    text: str, where: str, says: str
) -> None:
    found = refused(text)
    assert any(p == where and says in m for p, m in found), found
    assert refused("name: a\x00") == [("", "the document holds a NUL byte")]


@pytest.mark.parametrize(
    ("limits", "where", "says"),
    [
        ({"max_steps": 1_000_000_000_000}, "/limits/max_steps", "must be <= 1000"),
        ({"max_steps": -3}, "/limits/max_steps", "must be >= 1"),
        ({"max_steps": 2.5}, "/limits/max_steps", "must be a whole number"),
        ({"max_steps": True}, "/limits/max_steps", "must be a whole number"),
        ({"max_tool_calls": 10**10}, "/limits/max_tool_calls", "must be <= 10000"),
        ({"wall_clock_seconds": 0}, "/limits/wall_clock_seconds", "must be >= 1"),
        ({"max_cost_usd": 0}, "/limits/max_cost_usd", "must be > 0"),
        ({"max_cost_usd": 1e300}, "/limits/max_cost_usd", "must be <= 100000"),
        ({"max_tokens_per_turn": 10**9}, "/limits/max_tokens_per_turn", "must be <= 128000"),
        ({"max_running": 0}, "/limits/max_running", "must be >= 1"),
        ({"max_running": -2}, "/limits/max_running", "must be >= 1"),
        ({"max_running": 2.5}, "/limits/max_running", "must be a whole number"),
        ({"max_running": "3"}, "/limits/max_running", "must be a whole number"),
        ({"max_running": 10**6}, "/limits/max_running", "must be <= 100000"),
        (
            {"backoff_initial_seconds": 9, "backoff_max_seconds": 2},
            "/limits/backoff_initial_seconds",
            "must be <= backoff_max_seconds (2)",
        ),
    ],
)
def test_negative_or_absurd_limits_are_refused(
    limits: dict[str, Any], where: str, says: str
) -> None:
    assert refused({"name": "a", "limits": limits}) == [(where, says)]


@pytest.mark.parametrize(
    ("document", "where", "says"),
    [
        ({"name": "a\n"}, "/name", "must be an identifier"),
        ({"name": "x" * 129}, "/name", "must be at most 128 characters"),
        ({"name": "-a"}, "/name", "must be an identifier"),
        ({"name": "a", "routes": [{"source": "sms"}]}, "/routes/0/source", "must be one of"),
        ({"name": "a", "routes": [{"channel": "wa wa"}]}, "/routes/0/channel", "identifier"),
        (
            {"name": "a", "instructions": "x", "persona": CALENDAR},
            "/instructions",
            "give either instructions or a persona, not both",
        ),
        (
            {
                "name": "a",
                "approvals": {
                    "always_allow_scopes": [],
                    "tools": {"x": {"decisions": ["allow-always", "deny"]}},
                },
            },
            "/approvals/tools/x/decisions",
            "offers allow-always",
        ),
        ({"name": "a", "personas": [CONCIERGE, CONCIERGE]}, "/personas/1/name", "repeats"),
        ({"name": "a", "routes": [{}, {}]}, "/routes/1", "repeats /routes/0"),
    ],
)
def test_bad_names_routes_and_contradictions_are_refused(
    document: dict[str, Any], where: str, says: str
) -> None:
    found = refused(document)
    assert len(found) == 1 and found[0][0] == where and says in found[0][1], found


def test_identical_documents_have_one_digest_whatever_their_syntax_or_key_order() -> None:
    as_json = agent_spec.parse(json.dumps(FULL))
    shuffled = json.dumps(dict(reversed(list(FULL.items()))), indent=4)
    as_yaml = agent_spec.parse(yaml.safe_dump(FULL, sort_keys=True, default_flow_style=False))
    spelled = json.dumps(FULL).replace("0.123457", "0.1234570").replace(": 12,", ": 12.0,")
    texts = (shuffled, spelled)
    digests = {agent_spec.parse(t).digest for t in texts} | {as_json.digest, as_yaml.digest}
    assert digests == {as_json.digest} and spelled != json.dumps(FULL)
    assert as_yaml.written != as_json.written
    changed = agent_spec.parse(json.dumps({**FULL, "limits": {**FULL["limits"], "max_steps": 11}}))
    assert changed.digest != as_json.digest


SPECIFIC = [
    ("both", [Route("chat", "whatsapp")]),
    ("source", [Route("chat", "")]),
    ("channel", [Route("", "whatsapp")]),
    ("any", [Route()]),
    ("silent", []),
]


@pytest.mark.parametrize(
    ("source", "channel", "agent"),
    [
        ("chat", "whatsapp", "both"),
        ("chat", "web", "source"),
        ("messaging", "whatsapp", "channel"),
        ("task", "jira", "any"),
    ],
)
def test_the_most_specific_route_takes_the_run(source: str, channel: str, agent: str) -> None:
    assert Route("chat", "whatsapp").specificity == 3 and Route().specificity == 0
    assert agent_spec.pick(SPECIFIC, "silent", source, channel) == agent
    assert agent_spec.pick(reversed(SPECIFIC), "silent", source, channel) == agent


def test_without_a_matching_route_the_default_takes_the_run_or_none_does() -> None:
    routed = [("support", [Route("", "whatsapp")]), ("silent", [])]
    assert agent_spec.pick(routed, "default", "chat", "web") == "default"
    assert agent_spec.pick(routed, None, "chat", "web") is None
    assert agent_spec.pick(routed, "default", "messaging", "whatsapp") == "support"


def test_agents_declaring_an_equal_route_are_named_both() -> None:
    agents = [
        ("a", [Route("chat", ""), Route("", "web")]),
        ("b", [Route("chat", "web")]),
        ("c", [Route("", "web"), Route("", "web")]),
        ("d", [Route("chat", "")]),
    ]
    assert agent_spec.route_conflicts(agents) == [
        ("a", "c", Route("", "web")),
        ("a", "d", Route("chat", "")),
    ]
    assert agent_spec.route_conflicts(agents[:2]) == []


PAIRS = [("chat", "chat"), ("chat", "whatsapp"), ("messaging", "whatsapp"), ("task", "jira")]


def resolved_alike(spec: AgentSpec, overrides: dict[str, Any]) -> None:
    """Everything alike but the approvals, which the document's run carries (a run of
    `tenants.agent` leaves them to the tenant's policy)."""
    for source, channel in PAIRS:
        config = routing.resolve(spec.overrides(), source, channel)
        assert json.loads(config.approvals) == spec.approvals()
        assert replace(config, approvals="") == routing.resolve(overrides, source, channel), (
            source,
            channel,
        )


def test_a_document_resolves_to_the_config_its_tenants_agent_json_gives_today() -> None:
    spec = agent_spec.parse(json.dumps(FULL))
    today = {
        "agent": "helper",
        "model": FULL["model"],
        "persona": FULL["persona"],
        "personas": FULL["personas"],
        "skills": FULL["skills"],
        "tool_allowlist": FULL["tools"],
        "context": FULL["context"],
        "limits": {
            **{k: v for k, v in FULL["limits"].items() if k != "max_cost_usd"},
            "max_cost_micros": 123_457,
        },
        "prices": FULL["prices"],
    }
    resolved_alike(spec, today)
    config = routing.resolve(spec.overrides(), "chat", "whatsapp")
    assert config.limits.max_cost_micros == 123_457
    assert config.prices["claude-opus-5-5"].output == 15.5
    assert config.persona is not None and config.persona.ref == "concierge@2"
    assert [s.ref for s in config.skills] == ["calendar@3"]
    instructed = agent_spec.parse('{"name": "x", "instructions": "Be brief."}')
    resolved_alike(instructed, {"agent": "x", "system_prompt": "Be brief."})


def tenants_agent(config: Any) -> dict[str, Any]:
    """`config` (an AgentConfig) spelt out as tenants.agent JSON."""
    stored = config.to_json()
    return {
        "model": stored["model"],
        "persona": stored["persona"],
        "tool_allowlist": stored["tool_allowlist"],
        "context": stored["context"],
        "limits": stored["limits"],
        "prices": stored["prices"],
    }


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        tenants_agent(routing.DEFAULT),
        {
            **tenants_agent(replace(routing.DEFAULT, model="claude-haiku-5-5")),
            "personas": [CONCIERGE],
            "skills": [CALENDAR],
            "limits": {"max_steps": 3, "max_cost_micros": 1_234_567, "wall_clock_seconds": 42},
            "prices": {
                "claude-haiku-5-5": {"input": 1, "output": 2, "cache_write": 3, "cache_read": 0.1}
            },
        },
        {"system_prompt": "Be brief.", "tool_allowlist": ["get_time", "get_time"]},
    ],
    ids=["empty", "demo", "customised", "system_prompt"],
)
def test_todays_configuration_round_trips_through_a_document(overrides: dict[str, Any]) -> None:
    document = agent_spec.from_overrides("default", overrides, {"always_allow_scopes": ["tenant"]})
    spec = agent_spec.parse(json.dumps(document))
    resolved_alike(spec, overrides)
    assert spec.approvals()["always_allow_scopes"] == ["tenant"]
    assert routing.resolve(spec.overrides()).agent == "default"


def test_a_limit_a_document_cannot_hold_becomes_the_nearest_it_can() -> None:
    document = agent_spec.from_overrides(
        "default", {"limits": {"max_steps": 0, "max_tool_calls": 10**9, "max_cost_micros": 7}}, {}
    )
    assert document["limits"] == {"max_tool_calls": 10_000, "max_cost_usd": 7e-06}
    limits = routing.resolve(agent_spec.parse(json.dumps(document)).overrides()).limits
    assert (limits.max_steps, limits.max_cost_micros) == (routing.DEFAULT.limits.max_steps, 7)
    assert agent_spec.parse(json.dumps(agent_spec.from_overrides("d", {}, {}))).approvals() == {
        "always_allow_scopes": ["principal"]
    }


def test_the_examples_are_accepted_and_the_demo_is_todays_demo_agent() -> None:
    demo = agent_spec.parse((EXAMPLES / "demo.yaml").read_text())
    config = routing.resolve(demo.overrides(), "chat", "chat")
    assert replace(config, approvals="") == routing.DEFAULT
    assert json.loads(config.approvals) == demo.approvals()
    assert demo.routes == ()
    support = agent_spec.parse((EXAMPLES / "support.yaml").read_bytes())
    agents = [(demo.name, demo.routes), (support.name, support.routes)]
    assert agent_spec.pick(agents, "default", "messaging", "whatsapp") == "support"
    assert agent_spec.pick(agents, "default", "chat", "chat") == "default"
    config = routing.resolve(support.overrides(), "messaging", "whatsapp")
    assert config.limits.max_steps < routing.DEFAULT.limits.max_steps
    assert config.limits.max_cost_micros == 250_000
    policy = support.approvals()
    assert agent_spec.offered_decisions(policy, "send_reply_tool", "send_reply", ("deny",)) == [
        "allow-once",
        "allow-conversation",
        "deny",
    ]
    assert agent_spec.approval_ttl_seconds(policy, "x", "send_reply", 86_400) == 900
    assert agent_spec.approval_ttl_seconds(policy, "x", "publish", 86_400) == 3600


def test_the_schema_refuses_unknown_fields_and_bounds_every_limit() -> None:
    schema = agent_spec.schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    objects = [schema, *(d for d in schema["$defs"].values() if d.get("type") == "object")]
    objects += [
        p for d in objects for p in d.get("properties", {}).values() if p.get("type") == "object"
    ]
    assert all(
        o["additionalProperties"] is not True and "additionalProperties" in o for o in objects
    )
    for name, limit in schema["$defs"]["limits"]["properties"].items():
        assert "maximum" in limit and limit.get("description"), name
        assert limit.get("minimum", 0) >= 1 or "exclusiveMinimum" in limit, name


def test_an_agents_cap_on_runs_at_once_is_its_routings_and_only_a_cap_is_stored() -> None:
    capped = agent_spec.parse('{"name": "a", "limits": {"max_running": 3, "max_steps": 2}}')
    config = routing.resolve(capped.overrides())
    assert (config.max_running, config.limits.max_steps) == (3, 2)
    assert config.to_json()["max_running"] == 3
    assert AgentConfig.from_json(config.to_json()) == config
    # No cap: the stored form (so the routing's name, its digest) is what it was before caps.
    uncapped = routing.resolve(agent_spec.parse('{"name": "a"}').overrides())
    assert uncapped.max_running == 0 and "max_running" not in uncapped.to_json()
