"""Which of an MCP server's tools a run is offered, under which name and risk: pure functions
over what `tools/list` answered, so the rules are the same at every lease and testable alone.

- A tool is offered as `server__tool` (`tether.mcp_wire.offered_name`) when the agent's entry
  allowlists it; the offer is sorted by that name, and each tool's spec is canonical JSON, so
  the tools block of the prompt is byte-stable from one lease to the next (the prompt cache).
- A tool whose input schema is not a valid JSON Schema (draft 2020-12) object schema, or whose
  schema is over 64 KiB as canonical JSON, is left out with a warning.
- A name that collides (a server listing one tool twice, or an offered name equal to one the
  run already offers) is left out with a warning: the first holder keeps it.
- An allowlisted tool the server does not list is a warning too (renamed or removed upstream).
- Risk: the agent's override for the tool, else from the tool's annotations (`risk_of`).

Warnings are returned as data (`Offer.warnings`), for the run to carry.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from tether.domain import McpServer
from tether.mcp_wire import MAX_OFFERED_NAME, offered_name

MAX_SCHEMA_BYTES = 64 * 1024
"""The largest input schema offered (canonical JSON, UTF-8): past it a schema costs the
model's context more than any tool is worth, and is more likely a mistake than a design."""

READ = "read"
DELETE = "delete"
EXTERNAL_SHARE = "external_share"
DEFAULT_RISK = DELETE
"""The category of a tool whose annotations say none of readOnly, destructive or openWorld.
`delete`, as the MCP specification reads a tool that says nothing: `destructiveHint` defaults
to true. Gated by policy like every category but `read`; the agent's `risk` overrides it."""

_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


@dataclass(frozen=True, slots=True)
class ListedTool:
    """A tool as a server's `tools/list` answered it (the SDK's `Tool`, reduced)."""

    name: str
    description: str
    input_schema: Any
    annotations: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class OfferedTool:
    """One MCP tool as the run offers it. `spec` is what the model sees (`{"name",
    "description", "input_schema"}`); `tool` is the name the server knows it by. Every MCP
    call leaves the worker, so each one is an effect of the run (`writes_externally`)."""

    name: str
    server: str
    tool: str
    description: str
    input_schema: Mapping[str, Any]
    risk: str
    writes_externally: bool = True

    @property
    def spec(self) -> dict[str, Any]:
        """The Messages API tool parameter."""
        return {
            "name": self.name,
            "description": self.description,
            "input_schema": self.input_schema,
        }


@dataclass(frozen=True, slots=True)
class Offer:
    """What a run is offered of its MCP servers: tools sorted by name, and why any were left
    out (one sentence each, naming server and tool)."""

    tools: tuple[OfferedTool, ...] = ()
    warnings: tuple[str, ...] = ()

    def find(self, name: str) -> OfferedTool | None:
        """The offered tool called `name`, if any."""
        return next((t for t in self.tools if t.name == name), None)


def risk_of(annotations: Mapping[str, Any], override: str | None = None) -> str:
    """A tool's risk category: `override` (the agent's) when given, else `readOnlyHint` is
    read; `destructiveHint` is delete; `openWorldHint` without `readOnlyHint` is
    external_share; else `DEFAULT_RISK`. Only an explicit `true` counts as a hint."""
    if override:
        return override
    if annotations.get("readOnlyHint") is True:
        return READ
    if annotations.get("destructiveHint") is True:
        return DELETE
    if annotations.get("openWorldHint") is True:
        return EXTERNAL_SHARE
    return DEFAULT_RISK


def schema_problem(schema: Any) -> str | None:
    """Why `schema` cannot be offered as a tool's input schema, or None when it can."""
    if not isinstance(schema, Mapping):
        return "its input schema is not an object"
    if schema.get("type") != "object":
        return 'its input schema is not of type "object"'
    try:
        size = len(canonical(schema).encode("utf-8"))
    except (TypeError, ValueError):
        return "its input schema is not JSON"
    if size > MAX_SCHEMA_BYTES:
        return f"its input schema is {size} bytes, over the {MAX_SCHEMA_BYTES} allowed"
    return _metaschema_problem(canonical(schema))


@functools.lru_cache(maxsize=1024)
def _metaschema_problem(text: str) -> str | None:
    """Checked once per distinct schema: the metaschema check costs milliseconds, and a lease
    on a warm listing should cost next to nothing."""
    try:
        jsonschema.Draft202012Validator.check_schema(json.loads(text))
    except jsonschema.SchemaError as exc:
        return f"its input schema is not a valid JSON Schema: {exc.message}"
    return None


def canonical(value: Any) -> str:
    """The one JSON text of `value`: keys sorted, no spaces."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


def server_offer(server: McpServer, listed: Iterable[ListedTool]) -> Offer:
    """The tools of one server a run is offered, from its listing."""
    allowed = set(server.tools)
    seen: set[str] = set()
    tools: list[OfferedTool] = []
    warnings: list[str] = []
    for tool in listed:
        if tool.name not in allowed:
            continue
        where = f"MCP tool {tool.name!r} of server {server.name!r}"
        name = offered_name(server.name, tool.name)
        if tool.name in seen:
            warnings.append(f"{where} is listed twice by the server; only the first is offered")
            continue
        seen.add(tool.name)
        if len(name) > MAX_OFFERED_NAME or not set(name) <= _NAME_CHARS:
            warnings.append(f"{where} is left out: {name!r} is not a name a model can call")
            continue
        problem = schema_problem(tool.input_schema)
        if problem is not None:
            warnings.append(f"{where} is left out: {problem}")
            continue
        tools.append(
            OfferedTool(
                name=name,
                server=server.name,
                tool=tool.name,
                description=tool.description,
                # A copy through canonical JSON: key order is the same at every lease.
                input_schema=json.loads(canonical(tool.input_schema)),
                risk=risk_of(tool.annotations, server.risk.get(tool.name)),
            )
        )
    for missing in sorted(allowed - seen):
        warnings.append(
            f"MCP tool {missing!r} of server {server.name!r} is allowlisted but the server "
            "does not list it"
        )
    return Offer(tuple(sorted(tools, key=lambda t: t.name)), tuple(warnings))


def merge(offers: Iterable[Offer], taken: Iterable[str] = ()) -> Offer:
    """One offer of several servers' (in the agent's order): a name already taken (by the
    run's other tools, `taken`, or an earlier server's) is left out with a warning."""
    names = set(taken)
    tools: list[OfferedTool] = []
    warnings: list[str] = []
    for offer in offers:
        warnings.extend(offer.warnings)
        for tool in offer.tools:
            if tool.name in names:
                warnings.append(
                    f"MCP tool {tool.tool!r} of server {tool.server!r} is left out: the run "
                    f"already offers a tool named {tool.name!r}"
                )
                continue
            names.add(tool.name)
            tools.append(tool)
    return Offer(tuple(sorted(tools, key=lambda t: t.name)), tuple(warnings))
