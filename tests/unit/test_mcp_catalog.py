"""What a run is offered of an MCP server (services.worker.mcp.catalog): risk from annotations
unless the agent overrides it, `server__tool` names sorted and byte-stable, tools with an invalid
or over-64-KiB schema or an uncallable name left out with a warning, collisions left out with a
warning; and the OAuth helpers (the challenge's parameters, the PKCE authorisation URL)."""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any
from urllib.parse import parse_qs, urlsplit

import jsonschema
import pytest

from services.worker.mcp import DEFAULT_RISK, MAX_SCHEMA_BYTES, ListedTool, risk_of
from services.worker.mcp.catalog import canonical, merge, schema_problem, server_offer
from services.worker.mcp.oauth import authorization_url, challenge_params, pkce_pair
from services.worker.mcp.outcome import AuthChallenge
from tether.domain import McpServer

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"order_id": {"type": "string"}},
    "required": ["order_id"],
}


def tool(name: str, schema: Any = None, **hints: bool) -> ListedTool:
    return ListedTool(name, f"does {name}", SCHEMA if schema is None else schema, hints)


def server(*tools: str, name: str = "orders", **risk: str) -> McpServer:
    return McpServer(name, "https://mcp.example.com/mcp", tools, risk=risk)


@pytest.mark.parametrize(
    ("hints", "risk"),
    [
        ({"readOnlyHint": True}, "read"),
        ({"readOnlyHint": True, "destructiveHint": True}, "read"),
        ({"readOnlyHint": True, "openWorldHint": True}, "read"),
        ({"destructiveHint": True}, "delete"),
        ({"destructiveHint": True, "openWorldHint": True}, "delete"),
        ({"openWorldHint": True}, "external_share"),
        ({"readOnlyHint": False, "openWorldHint": True}, "external_share"),
        ({"readOnlyHint": False, "destructiveHint": False, "openWorldHint": False}, DEFAULT_RISK),
        ({}, DEFAULT_RISK),
        ({"readOnlyHint": "yes"}, DEFAULT_RISK),  # only an explicit true is a hint
    ],
)
def test_risk_follows_the_annotations(hints: dict[str, Any], risk: str) -> None:
    assert risk_of(hints) == risk


def test_the_default_is_delete_and_the_agent_overrides_any_hint() -> None:
    assert DEFAULT_RISK == "delete"
    assert risk_of({"readOnlyHint": True}, "publish") == "publish"
    offer = server_offer(
        server("lookup", "purge", purge="read"),
        [tool("lookup", readOnlyHint=True), tool("purge", destructiveHint=True)],
    )
    assert [(t.name, t.risk) for t in offer.tools] == [
        ("orders__lookup", "read"),
        ("orders__purge", "read"),
    ]


def test_only_allowlisted_tools_are_offered_sorted_by_name_and_byte_stable() -> None:
    listed = [tool("zeta"), tool("alpha", {"required": ["b"], "type": "object"}), tool("hidden")]
    first = server_offer(server("zeta", "alpha", "absent"), listed)
    second = server_offer(server("zeta", "alpha", "absent"), list(reversed(listed)))
    assert [t.name for t in first.tools] == ["orders__alpha", "orders__zeta"]
    assert [t.tool for t in first.tools] == ["alpha", "zeta"]
    assert json.dumps([t.spec for t in first.tools]) == json.dumps([t.spec for t in second.tools])
    assert list(first.tools[0].input_schema) == ["required", "type"], "keys in canonical order"
    assert first.warnings == (
        "MCP tool 'absent' of server 'orders' is allowlisted but the server does not list it",
    )
    assert all(t.writes_externally for t in first.tools)
    assert first.find("orders__zeta") is first.tools[1]
    assert first.find("zeta") is None


@pytest.mark.parametrize(
    ("schema", "why"),
    [
        ([1, 2], "is not an object"),
        ({"type": "string"}, 'is not of type "object"'),
        ({"type": "object", "properties": 5}, "is not a valid JSON Schema"),
        ({"type": "object", "required": "order_id"}, "is not a valid JSON Schema"),
        ({"type": "object", "x": float("nan")}, "is not JSON"),
    ],
)
def test_a_tool_whose_schema_is_invalid_is_left_out_with_a_warning(schema: Any, why: str) -> None:
    offer = server_offer(server("bad", "good"), [tool("bad", schema), tool("good")])
    assert [t.tool for t in offer.tools] == ["good"]
    assert len(offer.warnings) == 1
    assert offer.warnings[0].startswith("MCP tool 'bad' of server 'orders' is left out: its")
    assert why in offer.warnings[0]


def _schema_of_size(size: int) -> dict[str, Any]:
    base = {"type": "object", "description": ""}
    base["description"] = "x" * (size - len(canonical(base).encode()))
    assert len(canonical(base).encode()) == size
    return base


def test_a_schema_over_64_kib_is_left_out_and_one_at_the_limit_is_offered() -> None:
    at_limit = _schema_of_size(MAX_SCHEMA_BYTES)
    over = _schema_of_size(MAX_SCHEMA_BYTES + 1)
    assert schema_problem(at_limit) is None
    jsonschema.Draft202012Validator.check_schema(at_limit)
    offer = server_offer(server("big", "fits"), [tool("big", over), tool("fits", at_limit)])
    assert [t.tool for t in offer.tools] == ["fits"]
    assert offer.warnings == (
        f"MCP tool 'big' of server 'orders' is left out: its input schema is "
        f"{MAX_SCHEMA_BYTES + 1} bytes, over the {MAX_SCHEMA_BYTES} allowed",
    )


def test_an_uncallable_name_and_a_tool_listed_twice_are_left_out_with_warnings() -> None:
    long_tool = "t" * 60
    offer = server_offer(
        server("a.b", long_tool, "twice"),
        [tool("a.b"), tool(long_tool), tool("twice"), tool("twice", {"type": "object"})],
    )
    assert [t.tool for t in offer.tools] == ["twice"]
    assert offer.tools[0].input_schema == SCHEMA, "the first listing wins"
    assert offer.warnings == (
        "MCP tool 'a.b' of server 'orders' is left out: 'orders__a.b' is not a name a model "
        "can call",
        f"MCP tool {long_tool!r} of server 'orders' is left out: 'orders__{long_tool}' is not "
        "a name a model can call",
        "MCP tool 'twice' of server 'orders' is listed twice by the server; only the first is "
        "offered",
    )


def test_names_colliding_among_the_offered_tools_are_left_out_with_a_warning() -> None:
    orders = server_offer(server("find", "get"), [tool("find"), tool("get")])
    crm = server_offer(server("find", name="crm"), [tool("find")])
    merged = merge([orders, crm], taken=["orders__get", "get_time"])
    assert [t.name for t in merged.tools] == ["crm__find", "orders__find"]
    assert merged.warnings == (
        "MCP tool 'get' of server 'orders' is left out: the run already offers a tool named "
        "'orders__get'",
    )
    twice = merge([crm, crm])
    assert [t.name for t in twice.tools] == ["crm__find"]
    assert len(twice.warnings) == 1


def test_the_challenge_parameters_are_read_quoted_or_not() -> None:
    header = (
        'Bearer error="insufficient_scope", scope="orders write", '
        'resource_metadata="https://mcp.example.com/.well-known/oauth-protected-resource/mcp", '
        "realm=mcp"
    )
    assert challenge_params(header) == {
        "error": "insufficient_scope",
        "scope": "orders write",
        "resource_metadata": "https://mcp.example.com/.well-known/oauth-protected-resource/mcp",
        "realm": "mcp",
    }
    assert challenge_params('Basic realm="x"') == {}


def test_the_authorisation_url_carries_pkce_s256_state_and_resource() -> None:
    challenge = AuthChallenge(
        status=401,
        gap="absent",
        scopes=("orders",),
        resource="https://mcp.example.com/mcp",
        authorization_endpoint="https://auth.example.com/authorize?tenant=x",
    )
    verifier, sent_challenge = pkce_pair()
    url = authorization_url(
        challenge,
        client_id="tether",
        redirect_uri="https://tether.example.com/callback",
        state="s-1",
        code_verifier=verifier,
    )
    query = {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}
    expected = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=")
    assert query == {
        "tenant": "x",
        "response_type": "code",
        "client_id": "tether",
        "redirect_uri": "https://tether.example.com/callback",
        "state": "s-1",
        "code_challenge": expected.decode(),
        "code_challenge_method": "S256",
        "scope": "orders",
        "resource": "https://mcp.example.com/mcp",
    }
    assert sent_challenge == expected.decode()
    assert verifier not in url
    with pytest.raises(ValueError, match="no authorisation endpoint"):
        authorization_url(
            AuthChallenge(401, "absent"),
            client_id="c",
            redirect_uri="r",
            state="s",
            code_verifier=verifier,
        )
