"""Tool input checked against the tool's JSON Schema (draft 2020-12, by `jsonschema`) before
the tool runs, with violations worded for the model that has to fix its call.

`check_schema` runs when the registry is built: the schema must be valid under the metaschema,
and every keyword must be one the validator enforces or a plain annotation, so a typo
(`"maxLenght"`) or a format no checker knows fails the worker at startup instead of letting
input through unchecked (jsonschema itself ignores unknown keywords and unchecked formats).

`normalize` runs first: where the schema says `integer`, an integral float (`5.0`) becomes the
`int` 5. Input arrives with every number a float (a tool call keeps them as doubles, as protobuf's
`Struct` carries them, see `tether.domain.ToolCall`), and a tool declaring an integer should get an
`int`; validation itself then refuses any float for `integer` (jsonschema's own type checker would
take 5.0). `number` refuses NaN and infinities, which have no JSON spelling, and booleans are
never numbers.

Every call pays the check, so an input is first tried against the same schema compiled by
`jsonschema-rs` (Rust; about a hundredth of the time): where it finds the input valid, so would
`jsonschema`, for a schema built only from `FAST_KEYWORDS` (where `normalize` has already made
every integral float an `int` wherever an integer is declared; no `format`, `pattern` or
`multipleOf`, whose dialects or arithmetic could differ). Any other schema, and every input the
fast check refuses, takes `jsonschema`, whose words the model reads; so the fast check can only
ever save time, never decide a refusal. tests/unit/test_schema_fast_path.py holds the two to the
same verdicts on generated schemas and inputs.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jsonschema
import jsonschema_rs
from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError

ROOT = "input"
# Keywords that constrain nothing, so accepting them never lets input through unchecked.
ANNOTATIONS = frozenset(
    {
        "$schema",
        "$id",
        "$defs",
        "$comment",
        "title",
        "description",
        "default",
        "examples",
        "deprecated",
        "readOnly",
        "writeOnly",
    }
)
SUPPORTED_KEYWORDS = frozenset(Draft202012Validator.VALIDATORS) | ANNOTATIONS
CHECKED_FORMATS = frozenset(Draft202012Validator.FORMAT_CHECKER.checkers)
# The keywords of a schema the fast check may pass for `jsonschema` (see the module).
FAST_KEYWORDS = ANNOTATIONS - {"$defs"} | frozenset(
    {
        *("type", "properties", "required", "additionalProperties", "items", "enum", "const"),
        *("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"),
        *("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"),
        *("anyOf", "oneOf"),
    }
)
# Where a schema holds subschemas: one, a list of them, or a mapping of names to them.
_ONE = (
    *("additionalProperties", "items", "contains", "not", "if", "then", "else"),
    *("propertyNames", "unevaluatedItems", "unevaluatedProperties"),
)
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")
_NAMED = ("properties", "patternProperties", "$defs", "dependentSchemas")
# A message jsonschema words itself can quote the whole input; the model needs the start.
MAX_MESSAGE_CHARS = 300


class SchemaError(ValueError):
    """The schema itself is malformed, or uses something this validator does not enforce."""


@dataclass(frozen=True, order=True)
class Violation:
    """One reason an instance does not match: where (`input.items[2].name`) and why."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def _is_integer(_: Any, instance: Any) -> bool:
    # bool is a subclass of int in Python but a distinct type in JSON.
    return isinstance(instance, int) and not isinstance(instance, bool)


def _is_number(_: Any, instance: Any) -> bool:
    if isinstance(instance, bool):
        return False
    return isinstance(instance, int) or (isinstance(instance, float) and math.isfinite(instance))


_Validator = jsonschema.validators.extend(
    Draft202012Validator,
    type_checker=Draft202012Validator.TYPE_CHECKER.redefine_many(
        {"integer": _is_integer, "number": _is_number}
    ),
)


class InputSchema:
    """A tool's input schema, checked and compiled once; `violations` per call."""

    def __init__(self, schema: Mapping[str, Any], path: str = ROOT) -> None:
        """Raises SchemaError unless `schema` is valid and enforced whole (see the module)."""
        check_schema(schema, path)
        self.schema = schema
        self._validator = _Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
        self._fast = (
            jsonschema_rs.Draft202012Validator(dict(schema)) if fast_checkable(schema) else None
        )

    def violations(self, instance: Any, path: str = ROOT) -> list[Violation]:
        """Every violation of the schema by `instance` (normalised), by path; empty when it
        matches."""
        if self._fast is not None and self._fast.is_valid(instance):
            return []
        return _worded(self._validator.iter_errors(instance), path)


def fast_checkable(schema: Any) -> bool:
    """Whether the fast check's verdict of valid stands for `schema` (see the module): every
    subschema, at every depth, uses only FAST_KEYWORDS."""
    if isinstance(schema, bool):
        return True
    if not isinstance(schema, Mapping) or not set(schema) <= FAST_KEYWORDS:
        return False
    branches = [*schema.get("anyOf", ()), *schema.get("oneOf", ())]
    subschemas = [schema.get(k) for k in ("additionalProperties", "items") if k in schema]
    subschemas += list(schema.get("properties", {}).values())
    return _one_branch_fits(schema) and all(fast_checkable(s) for s in [*branches, *subschemas])


def _one_branch_fits(schema: Mapping[str, Any]) -> bool:
    """Whether each of the schema's anyOf / oneOf branches declares its types, none shared with
    another branch (integer and number count as one): then the branch `normalize` follows is
    the only one an instance can match, and nothing under another is left unnormalised."""
    for key in ("anyOf", "oneOf"):
        seen: set[str] = set()
        for branch in schema.get(key, ()):
            if not isinstance(branch, Mapping) or "type" not in branch:
                return False
            declared = branch["type"]
            kinds = {"number" if t == "integer" else t for t in _types(declared)}
            if kinds & seen:
                return False
            seen |= kinds
    return True


def _types(declared: Any) -> list[str]:
    return [declared] if isinstance(declared, str) else list(declared or [])


def check_schema(schema: Mapping[str, Any], path: str = ROOT) -> None:
    """Raise SchemaError unless `schema` is valid under draft 2020-12 and every keyword, at
    every depth, is enforced (or an annotation), every format checked."""
    try:
        Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "".join(f"/{p}" for p in exc.path)
        raise SchemaError(f"{path}: invalid schema at '{where or '/'}': {exc.message}") from exc
    _check_keywords(schema, path)


def _check_keywords(schema: Any, path: str) -> None:
    if not isinstance(schema, Mapping):
        return  # a boolean schema: true takes anything, false nothing
    unknown = sorted(set(schema) - SUPPORTED_KEYWORDS)
    if unknown:
        raise SchemaError(f"{path}: unsupported schema keywords {unknown}")
    if "format" in schema and schema["format"] not in CHECKED_FORMATS:
        raise SchemaError(
            f"{path}: format {schema['format']!r} is not checked (checked: "
            f"{', '.join(sorted(CHECKED_FORMATS))})"
        )
    for key in _ONE:
        if key in schema:
            _check_keywords(schema[key], f"{path}.{key}")
    for key in _LIST:
        for index, child in enumerate(schema.get(key, ())):
            _check_keywords(child, f"{path}.{key}[{index}]")
    for key in _NAMED:
        for name, child in schema.get(key, {}).items():
            _check_keywords(child, f"{path}.{name}" if key == "properties" else f"{path}.{key}")


def normalize(schema: Mapping[str, Any], instance: Any) -> Any:
    """`instance` with integral floats turned into ints where `schema` says integer (not number).

    Returns a new value and leaves `instance` alone; parts the schema does not describe, or that
    do not match it, come back unchanged for validation to judge. Under `anyOf`/`oneOf` (an
    optional value: `{"anyOf": [{"type": "integer"}, {"type": "null"}]}`) the first branch whose
    type fits the instance normalises it.
    """
    for key in ("anyOf", "oneOf"):
        for branch in schema.get(key, ()):
            if isinstance(branch, Mapping) and _fits(branch, instance):
                return normalize(branch, instance)
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else list(declared or [])
    if (
        isinstance(instance, float)
        and instance.is_integer()
        and "integer" in types
        and "number" not in types
    ):
        return int(instance)
    items = schema.get("items")
    if isinstance(instance, list) and isinstance(items, Mapping):
        return [normalize(items, item) for item in instance]
    if isinstance(instance, dict):
        return {
            name: normalize(_property_schema(schema, name), value)
            for name, value in instance.items()
        }
    return instance


def _fits(schema: Mapping[str, Any], instance: Any) -> bool:
    """Whether `schema` declares a type the instance has (an integral float fits integer)."""
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else list(declared or [])
    if isinstance(instance, float):
        return "number" in types or ("integer" in types and instance.is_integer())
    if isinstance(instance, list):
        return "array" in types
    if isinstance(instance, dict):
        return "object" in types
    return False


def _property_schema(schema: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    properties: Mapping[str, Any] = schema.get("properties", {})
    found = properties.get(name, schema.get("additionalProperties"))
    return found if isinstance(found, Mapping) else {}


def validate(schema: Mapping[str, Any], instance: Any, path: str = ROOT) -> list[Violation]:
    """Every violation of `schema` by `instance`, by path; empty when it matches. Compiles the
    schema each call: a caller checking many inputs keeps an `InputSchema`."""
    validator = _Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
    return _worded(validator.iter_errors(instance), path)


def _worded(errors: Iterable[ValidationError], root: str) -> list[Violation]:
    """The errors as violations, one per place and reason, sorted; where the type is wrong,
    only that is said (the other rules there follow once the type is right)."""
    found = {v for error in errors for v in _violations(error, root)}
    mistyped = {v.path for v in found if v.message.startswith("must be of type ")}
    return sorted(
        v for v in found if v.path not in mistyped or v.message.startswith("must be of type ")
    )


def _violations(error: ValidationError, root: str) -> Iterator[Violation]:
    path = root + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
    keyword, value, instance = error.validator, error.validator_value, error.instance
    if keyword == "type":
        types = [value] if isinstance(value, str) else list(value)
        yield Violation(path, f"must be of type {' or '.join(types)}")
    elif keyword == "required":
        for name in value:
            if isinstance(instance, dict) and name not in instance:
                yield Violation(f"{path}.{name}", "is required")
    elif keyword == "additionalProperties" and value is False and isinstance(instance, dict):
        for name in _additional(error.schema, instance):
            yield Violation(f"{path}.{name}", "is not an allowed property")
    elif keyword == "enum":
        yield Violation(path, f"must be one of {value!r}")
    elif keyword == "minLength":
        yield Violation(path, f"must be at least {value} characters long")
    elif keyword == "maxLength":
        yield Violation(path, f"must be at most {value} characters long")
    elif keyword == "minimum":
        yield Violation(path, f"must be >= {value}")
    elif keyword == "maximum":
        yield Violation(path, f"must be <= {value}")
    else:
        yield Violation(path, error.message[:MAX_MESSAGE_CHARS])


def _additional(schema: Mapping[str, Any], instance: Mapping[str, Any]) -> list[str]:
    """The properties of `instance` that neither `properties` nor `patternProperties` allow."""
    properties, patterns = schema.get("properties", {}), schema.get("patternProperties", {})
    return [
        name
        for name in instance
        if name not in properties and not any(re.search(p, name) for p in patterns)
    ]
