"""README.md's agent document reference is the one agent.schema.json makes: every field by its
path, type and bounds. It fails while README.md is stale; `make docs` rewrites it."""

from __future__ import annotations

from tether import agent_spec
from tether.stack import agent_reference, reference


def test_the_readme_agent_reference_is_what_the_schema_says() -> None:
    readme = reference.README.read_text()
    assert agent_reference.rewritten(readme) == readme, (
        "README.md's agent document reference is stale: run `make docs` and commit README.md"
    )


def test_every_field_of_the_schema_is_in_it() -> None:
    schema = agent_spec.schema()
    text = agent_reference.reference()
    for name in schema["properties"]:
        assert f"| `{name}`" in text, name
    for group in ("limits", "context", "approvals"):
        for name in schema["$defs"][group]["properties"]:
            assert f"| `{group}.{name}` |" in text, (group, name)
    for name in schema["$defs"]["approval"]["properties"]:
        assert f"| `approvals.risks.<name>.{name}` |" in text, name


def test_refs_lists_and_maps_are_followed_with_their_bounds() -> None:
    root = {
        "type": "object",
        "properties": {
            "limit": {"$ref": "#/$defs/count", "description": "How many."},
            "rows": {"type": "array", "maxItems": 3, "items": {"$ref": "#/$defs/row"}},
            "by_name": {"type": "object", "additionalProperties": {"$ref": "#/$defs/row"}},
        },
        "$defs": {
            "count": {"type": "integer", "minimum": 1, "maximum": 9, "description": "A count."},
            "row": {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}}},
        },
    }
    assert list(agent_reference.fields(root=root)) == [
        ("limit", "integer", ">= 1, <= 9", "How many."),
        ("rows", "list of object", "items <= 3", ""),
        ("rows[].kind", "`a` \\| `b`", "", ""),
        ("by_name", "map", "", ""),
        ("by_name.<name>.kind", "`a` \\| `b`", "", ""),
    ]
