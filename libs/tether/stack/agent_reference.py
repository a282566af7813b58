"""The agent document's reference in README.md, generated from its JSON Schema
(libs/tether/agent_spec/agent.schema.json): every field by its path, its type, its bounds and
what it means. `make docs` writes it with the settings reference (`tether.stack.reference`);
`tests/unit/test_agent_reference.py` fails while README.md differs from what this writes."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from tether.agent_spec import schema

BEGIN = "<!-- agent document reference: `make docs` writes it from agent.schema.json; edit that -->"
END = "<!-- end of the agent document reference -->"

# Schema keywords shown as bounds, with how each reads.
_BOUNDS = (
    ("minimum", ">= {}"),
    ("exclusiveMinimum", "> {}"),
    ("maximum", "<= {}"),
    ("minLength", "length >= {}"),
    ("maxLength", "length <= {}"),
    ("minItems", "items >= {}"),
    ("maxItems", "items <= {}"),
    ("maxProperties", "entries <= {}"),
)


def _resolved(node: Mapping[str, Any], root: Mapping[str, Any]) -> dict[str, Any]:
    """`node` with its `$ref` followed; the referring node's own keywords win."""
    merged = dict(node)
    while "$ref" in merged:
        ref = str(merged.pop("$ref")).removeprefix("#/$defs/")
        merged = {**root["$defs"][ref], **merged}
    return merged


def _type(node: Mapping[str, Any], root: Mapping[str, Any]) -> str:
    if "enum" in node:
        return " \\| ".join(f"`{v}`" for v in node["enum"])
    kind = str(node.get("type", "any"))
    if kind == "array":
        return f"list of {_type(_resolved(node.get('items', {}), root), root)}"
    if "format" in node:
        return f"{kind} ({node['format']})"
    return kind


def _bounds(node: Mapping[str, Any]) -> str:
    words = [text.format(node[key]) for key, text in _BOUNDS if key in node]
    if "contains" in node and "const" in node["contains"]:
        words.append(f"must hold `{node['contains']['const']}`")
    if node.get("uniqueItems"):
        words.append("no repeats")
    return ", ".join(words)


def fields(
    node: Mapping[str, Any] | None = None, path: str = "", root: Mapping[str, Any] | None = None
) -> Iterator[tuple[str, str, str, str]]:
    """(path, type, bounds, description) of every field under `node` (the whole document when
    None), depth first in the schema's order: `a.b` a field of an object, `a[]` an item of a
    list, `a.<name>` an entry of a map keyed by names."""
    root = root if root is not None else schema()
    node = _resolved(node if node is not None else root, root)
    for name, child in node.get("properties", {}).items():
        yield from _field(child, f"{path}.{name}" if path else name, root)


def _field(
    node: Mapping[str, Any], path: str, root: Mapping[str, Any]
) -> Iterator[tuple[str, str, str, str]]:
    node = _resolved(node, root)
    kind = "map" if isinstance(node.get("additionalProperties"), Mapping) else _type(node, root)
    what = str(node.get("description", "")).replace("|", "\\|").replace("\n", " ")
    yield path, kind, _bounds(node), what
    if "properties" in node:
        yield from fields(node, path, root)
    entry = node.get("additionalProperties")
    if isinstance(entry, Mapping):
        yield from fields(entry, f"{path}.<name>", root)
    items = _resolved(node.get("items", {}), root)
    if "properties" in items:
        yield from fields(items, f"{path}[]", root)


def reference() -> str:
    """The generated part of README.md, markers included."""
    document = schema()
    lines = [
        BEGIN,
        "",
        str(document["description"]),
        "",
        "| field | type | bounds | what |",
        "|---|---|---|---|",
    ]
    for path, kind, bounds, what in fields():
        required = " (required)" if path in document.get("required", ()) else ""
        lines.append(f"| `{path}`{required} | {kind} | {bounds} | {what} |")
    lines += ["", END]
    return "\n".join(lines)


def rewritten(readme: str) -> str:
    """`readme` with its agent document reference replaced by the current one."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README.md has no agent document reference between {BEGIN!r} and {END!r}")
    return readme[:start] + reference() + readme[end + len(END) :]
