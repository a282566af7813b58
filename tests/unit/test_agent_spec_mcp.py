"""An agent document's `mcp_servers`: accepted and normalised, every refusal at its pointer
(names repeated, a secret given inline, an unknown auth or transport, a risk for a tool not
allowlisted, a `server__tool` name colliding with another tool or too long), and the entries
carried by routing into AgentConfig, its stored form and its wire form."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.orchestrator import routing
from tether import agent_spec
from tether.convert.configs import config_from_proto, config_to_proto
from tether.domain import AgentConfig, McpServer
from tether.errors import InvalidArgument
from tether.mcp_wire import offered_name, split_offered_name

ORDERS: dict[str, Any] = {
    "name": "orders",
    "url": "https://mcp.example.com/mcp",
    "auth": {"bearer": "ORDERS_TOKEN"},
    "tools": ["lookup_order", "cancel_order"],
    "risk": {"cancel_order": "delete"},
}
CRM: dict[str, Any] = {"name": "crm", "url": "https://crm.example.com/mcp", "tools": ["find"]}


def _doc(**more: Any) -> str:
    return json.dumps({"name": "helper", "tools": ["get_time"], **more})


def _refusal(**more: Any) -> list[tuple[str, str]]:
    with pytest.raises(InvalidArgument) as refused:
        agent_spec.parse(_doc(**more))
    details = refused.value.details
    assert isinstance(details, dict)
    return [(v["pointer"], v["message"]) for v in details["violations"]]


def test_servers_are_accepted_normalised_and_read_as_routing_takes_them() -> None:
    spec = agent_spec.parse(_doc(mcp_servers=[ORDERS, {**CRM, "auth": "oauth"}]))
    assert spec.normalised["mcp_servers"][0] == dict(sorted(ORDERS.items()))
    config = routing.resolve(spec.overrides())
    assert config.mcp_servers == (
        McpServer(
            name="orders",
            url="https://mcp.example.com/mcp",
            tools=("lookup_order", "cancel_order"),
            auth="bearer",
            bearer_secret="ORDERS_TOKEN",
            risk={"cancel_order": "delete"},
        ),
        McpServer(name="crm", url="https://crm.example.com/mcp", tools=("find",), auth="oauth"),
    )
    assert AgentConfig.from_json(config.to_json()) == config
    assert config_from_proto(config_to_proto(config)) == config
    assert config.tool_allowlist[0] == "get_time", "the MCP tools are not in the allowlist"


def test_an_agent_without_servers_stores_and_digests_as_before() -> None:
    config = routing.resolve(agent_spec.parse(_doc()).overrides())
    assert config.mcp_servers == ()
    assert "mcp_servers" not in config.to_json()
    assert config_from_proto(config_to_proto(config)).mcp_servers == ()


@pytest.mark.parametrize(
    ("server", "pointer", "words"),
    [
        ({**ORDERS, "auth": {"bearer": "my token 123"}}, "/mcp_servers/0/auth", "none of"),
        ({**ORDERS, "auth": {"token": "x"}}, "/mcp_servers/0/auth", "{bearer: SECRET_NAME}"),
        ({**ORDERS, "auth": "basic"}, "/mcp_servers/0/auth", "none of the forms"),
        ({**ORDERS, "transport": "sse"}, "/mcp_servers/0/transport", "streamable-http"),
        ({**ORDERS, "name": "order__s"}, "/mcp_servers/0/name", "does not match"),
        ({**ORDERS, "name": "orders_"}, "/mcp_servers/0/name", "does not match"),
        ({**CRM, "tools": []}, "/mcp_servers/0/tools", "at least 1 item"),
        ({**CRM, "tools": ["a.b"]}, "/mcp_servers/0/tools/0", "does not match"),
        (
            {**ORDERS, "risk": {"lookup_order": "reckless"}},
            "/mcp_servers/0/risk/lookup_order",
            "one of",
        ),
        ({k: v for k, v in ORDERS.items() if k != "url"}, "/mcp_servers/0/url", "is required"),
        ({**ORDERS, "headers": {"x": "y"}}, "/mcp_servers/0/headers", "not a known field"),
        (
            {**ORDERS, "auth": {"bearer": "sk-live-51HqJ"}},
            "/mcp_servers/0/auth/bearer",
            "looks like a token",
        ),
        (
            {**ORDERS, "auth": {"bearer": "eyJhbGciOi"}},
            "/mcp_servers/0/auth/bearer",
            "looks like a token",
        ),
    ],
)
def test_a_malformed_server_is_refused_at_its_pointer(
    server: dict[str, Any], pointer: str, words: str
) -> None:
    found = _refusal(mcp_servers=[server])
    assert [p for p, _ in found] == [pointer], found
    assert words in found[0][1]
    auth = server.get("auth")
    if isinstance(auth, dict) and "bearer" in auth:
        assert auth["bearer"] not in found[0][1], "a value given as a secret is not echoed"


def test_names_risks_and_collisions_beyond_the_schema_are_refused_at_their_pointers() -> None:
    long_server = {**CRM, "name": "a" * 32, "tools": ["t" * 40]}
    found = _refusal(
        tools=["get_time", "orders__lookup_order"],
        skills=[
            {"name": "s", "version": 1, "instructions": "x", "tools": ["crm__find"]},
        ],
        mcp_servers=[
            {**ORDERS, "risk": {"cancel_order": "delete", "refund": "delete"}},
            CRM,
            {**CRM, "url": "https://other.example.com/mcp"},
            long_server,
        ],
    )
    assert found == [
        (
            "/mcp_servers/0/risk/refund",
            "names a tool not in /mcp_servers/0/tools: allowlist it or drop the entry",
        ),
        (
            "/mcp_servers/0/tools/0",
            "is offered to the model as 'orders__lookup_order', which /tools/1 already names: "
            "rename the server or drop one of the two",
        ),
        (
            "/mcp_servers/1/tools/0",
            "is offered to the model as 'crm__find', which /skills/0/tools/0 already names: "
            "rename the server or drop one of the two",
        ),
        ("/mcp_servers/2/name", "repeats /mcp_servers/1"),
        (
            "/mcp_servers/3/tools/0",
            f"is offered to the model as '{'a' * 32}__{'t' * 40}', longer than the 64 "
            "characters a tool name may have: shorten the server's name",
        ),
    ]


def test_an_offered_name_splits_back_into_server_and_tool() -> None:
    assert offered_name("orders", "lookup_order") == "orders__lookup_order"
    assert split_offered_name("orders__lookup__order") == ("orders", "lookup__order")
    assert split_offered_name("get_time") is None
    assert split_offered_name("__x") is None


def test_the_schema_describes_every_server_field() -> None:
    server = agent_spec.schema()["$defs"]["mcp_server"]
    assert server["additionalProperties"] is False
    assert all(p.get("description") for p in server["properties"].values())
