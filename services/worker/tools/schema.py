"""A small JSON Schema subset: enough to check tool input before a tool runs.

`jsonschema` is not among the pinned dependencies, and tool schemas need only a few keywords:
`type` (object, string, integer, number, boolean, array, null, or a list of them),
`properties`, `required`, `additionalProperties` (a boolean or a schema), `enum`,
`minLength`/`maxLength`, `minimum`/`maximum`, `items` (one schema), plus the annotations
`description`, `title`, `default` and `examples`. A schema using any other keyword is refused by
`check_schema` when the registry is built, so a constraint is never silently not enforced.

`normalize` runs first: where the schema says `integer`, an integral float (`5.0`) becomes the
`int` 5. Input arrives with every number a float (a tool call keeps them as doubles, as protobuf's
`Struct` carries them, see `tether.domain.ToolCall`), and a tool declaring an integer should get an
`int`; `validate` itself then refuses any float for `integer`. `number` refuses NaN and
infinities, which have no JSON spelling.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED_KEYWORDS = frozenset(
    {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "enum",
        "minLength",
        "maxLength",
        "minimum",
        "maximum",
        "items",
        "description",
        "title",
        "default",
        "examples",
    }
)
TYPE_NAMES = frozenset({"object", "string", "integer", "number", "boolean", "array", "null"})
ROOT = "input"


class SchemaError(ValueError):
    """The schema itself uses something this validator does not enforce, or is malformed."""


@dataclass(frozen=True)
class Violation:
    """One reason an instance does not match: where (`input.items[2].name`) and why."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def check_schema(schema: Mapping[str, Any], path: str = ROOT) -> None:
    """Raise SchemaError unless every keyword in `schema`, at every depth, is supported."""
    unknown = sorted(set(schema) - SUPPORTED_KEYWORDS)
    if unknown:
        raise SchemaError(f"{path}: unsupported schema keywords {unknown}")
    declared = schema.get("type")
    if declared is not None and not set(_as_list(declared)) <= TYPE_NAMES:
        raise SchemaError(f"{path}: unknown type {declared!r}")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
        raise SchemaError(f"{path}: required must be a list of property names")
    for name, child in _mapping(schema.get("properties", {}), path).items():
        check_schema(_mapping(child, path), f"{path}.{name}")
    extra = schema.get("additionalProperties", True)
    if not isinstance(extra, bool):
        check_schema(_mapping(extra, path), f"{path}.*")
    if "items" in schema:
        check_schema(_mapping(schema["items"], path), f"{path}[]")


def normalize(schema: Mapping[str, Any], instance: Any) -> Any:
    """`instance` with integral floats turned into ints where `schema` says integer (not number).

    Returns a new value and leaves `instance` alone; parts the schema does not describe, or that
    do not match it, come back unchanged for `validate` to judge.
    """
    declared = schema.get("type")
    types = _as_list(declared) if declared is not None else []
    if (
        isinstance(instance, float)
        and instance.is_integer()
        and "integer" in types
        and "number" not in types
    ):
        return int(instance)
    if isinstance(instance, list) and "items" in schema:
        return [normalize(schema["items"], item) for item in instance]
    if isinstance(instance, dict):
        return {
            name: normalize(_property_schema(schema, name), value)
            for name, value in instance.items()
        }
    return instance


def _property_schema(schema: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    properties: Mapping[str, Any] = schema.get("properties", {})
    if name in properties:
        return _mapping(properties[name], name)
    extra = schema.get("additionalProperties", True)
    return extra if isinstance(extra, Mapping) else {}


def validate(schema: Mapping[str, Any], instance: Any, path: str = ROOT) -> list[Violation]:
    """Every violation of `schema` by `instance`, in document order; empty when it matches."""
    declared = schema.get("type")
    if declared is not None:
        types = _as_list(declared)
        if not any(_is_type(instance, name) for name in types):
            return [Violation(path, f"must be of type {' or '.join(types)}")]
    if "enum" in schema and not any(_json_equal(instance, option) for option in schema["enum"]):
        return [Violation(path, f"must be one of {schema['enum']!r}")]
    if isinstance(instance, str):
        return _string_violations(schema, instance, path)
    if _is_type(instance, "number"):
        return _number_violations(schema, instance, path)
    if isinstance(instance, list):
        item_schema = schema.get("items")
        if item_schema is None:
            return []
        return [
            violation
            for index, item in enumerate(instance)
            for violation in validate(item_schema, item, f"{path}[{index}]")
        ]
    if isinstance(instance, dict):
        return _object_violations(schema, instance, path)
    return []


def _string_violations(schema: Mapping[str, Any], instance: str, path: str) -> list[Violation]:
    if "minLength" in schema and len(instance) < schema["minLength"]:
        return [Violation(path, f"must be at least {schema['minLength']} characters long")]
    if "maxLength" in schema and len(instance) > schema["maxLength"]:
        return [Violation(path, f"must be at most {schema['maxLength']} characters long")]
    return []


def _number_violations(schema: Mapping[str, Any], instance: float, path: str) -> list[Violation]:
    if "minimum" in schema and instance < schema["minimum"]:
        return [Violation(path, f"must be >= {schema['minimum']}")]
    if "maximum" in schema and instance > schema["maximum"]:
        return [Violation(path, f"must be <= {schema['maximum']}")]
    return []


def _object_violations(
    schema: Mapping[str, Any], instance: dict[Any, Any], path: str
) -> list[Violation]:
    properties: Mapping[str, Any] = schema.get("properties", {})
    found = [
        Violation(f"{path}.{name}", "is required")
        for name in schema.get("required", [])
        if name not in instance
    ]
    extra = schema.get("additionalProperties", True)
    for name, value in instance.items():
        child_path = f"{path}.{name}"
        if name in properties:
            found.extend(validate(properties[name], value, child_path))
        elif extra is False:
            found.append(Violation(child_path, "is not an allowed property"))
        elif isinstance(extra, Mapping):
            found.extend(validate(extra, value, child_path))
    return found


def _is_type(instance: Any, name: str) -> bool:
    # bool is a subclass of int in Python but a distinct type in JSON.
    if name == "boolean":
        return isinstance(instance, bool)
    if name == "integer":
        return isinstance(instance, int) and not isinstance(instance, bool)
    if name == "number":
        if isinstance(instance, bool):
            return False
        if isinstance(instance, int):
            return True
        return isinstance(instance, float) and math.isfinite(instance)
    if name == "string":
        return isinstance(instance, str)
    if name == "array":
        return isinstance(instance, list)
    if name == "object":
        return isinstance(instance, dict) and all(isinstance(key, str) for key in instance)
    return instance is None  # "null"; check_schema admits no other name


def _json_equal(left: Any, right: Any) -> bool:
    # Python says True == 1; JSON does not.
    if isinstance(left, bool) or isinstance(right, bool):
        return isinstance(left, bool) and isinstance(right, bool) and left == right
    return bool(left == right)


def _as_list(declared: Any) -> list[str]:
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list) and all(isinstance(name, str) for name in declared):
        return declared
    raise SchemaError(f"type must be a name or a list of names, not {declared!r}")


def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise SchemaError(f"{path}: expected a schema object, got {value!r}")
    return value
