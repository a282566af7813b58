"""The schema's check, in the document's words: jsonschema's errors become violations, each
with its pointer and a sentence a person acts on; the formats the schema names are checked
here (`identifier` by tether.ids, `timezone` by zoneinfo, `usd` to the micro-dollar)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from decimal import Decimal, InvalidOperation
from functools import cache
from importlib import resources
from typing import Any
from zoneinfo import ZoneInfo

import jsonschema

from tether.agent_spec.violations import Violation, pointer
from tether.ids import is_identifier

MICRO = Decimal("0.000001")
IDENTIFIER_WORDS = "an identifier: 1-128 of A-Z a-z 0-9 . _ : @ -, starting with a letter or digit"

_FORMATS = jsonschema.FormatChecker(formats=())


def _identifier(value: object) -> bool:
    # The characters only: the schema's minLength and maxLength say the length, once.
    return not isinstance(value, str) or not value or is_identifier(value, max_length=len(value))


def _optional_identifier(value: object) -> bool:
    return _identifier(value)


def _timezone(value: object) -> bool:
    if not isinstance(value, str):
        return True
    try:
        ZoneInfo(value)
    except (ValueError, KeyError, OSError):
        return False
    return True


def _usd(value: object) -> bool:
    if not isinstance(value, int | Decimal) or isinstance(value, bool):
        return True
    try:
        return Decimal(value).quantize(MICRO) == value
    except InvalidOperation:
        # Too large to hold in micro-dollars at all: `maximum` says so in plainer words.
        return True


for _name, _check in {
    "identifier": _identifier,
    "optional-identifier": _optional_identifier,
    "timezone": _timezone,
    "usd": _usd,
}.items():
    _FORMATS.checks(_name)(_check)


def _is_number(_: object, value: object) -> bool:
    return isinstance(value, int | Decimal) and not isinstance(value, bool)


def _is_integer(_: object, value: object) -> bool:
    if isinstance(value, Decimal):
        return value == value.to_integral_value()
    return isinstance(value, int) and not isinstance(value, bool)


# Numbers arrive as int or Decimal (never float: see loading); 8.0 is an integer, as JSON
# Schema says.
_Validator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine_many(
        {"number": _is_number, "integer": _is_integer}
    ),
)


@cache
def schema() -> dict[str, Any]:
    """The agent document's JSON Schema (2020-12), as it ships beside this module."""
    text = resources.files("tether.agent_spec").joinpath("agent.schema.json").read_text("utf-8")
    loaded: dict[str, Any] = json.loads(text)
    jsonschema.Draft202012Validator.check_schema(loaded)
    return loaded


@cache
def _validator() -> Any:
    return _Validator(schema(), format_checker=_FORMATS)


def violations(data: Any) -> Iterator[Violation]:
    """Every way `data` breaks the schema."""
    for error in _validator().iter_errors(data):
        yield from _explain(error)


_TYPES = {
    "integer": "a whole number",
    "number": "a number",
    "string": "text",
    "object": "an object",
    "array": "a list",
    "boolean": "true or false",
}
_FORMAT_WORDS = {
    "identifier": f"must be {IDENTIFIER_WORDS}",
    "optional-identifier": f"must be empty or {IDENTIFIER_WORDS}",
    "timezone": "must be a known time zone (e.g. Europe/Paris)",
    "usd": "must be in whole micro-dollars (at most 6 decimal places)",
}


def _explain(error: Any) -> Iterator[Violation]:
    path = list(error.absolute_path)
    kind, limit, instance = error.validator, error.validator_value, error.instance
    if "propertyNames" in error.absolute_schema_path:
        # jsonschema checks a key as the object's own instance; point at the key.
        path.append(instance)
    if kind == "additionalProperties":
        known = sorted(error.schema.get("properties", {}))
        for key in instance:
            if key not in known:
                words = f"; known: {', '.join(known)}" if known else ""
                yield Violation(pointer([*path, key]), f"is not a known field{words}")
        return
    if kind == "required":
        for key in limit:
            if isinstance(instance, Mapping) and key not in instance:
                yield Violation(pointer([*path, key]), "is required")
        return
    yield Violation(pointer(path), _words(kind, limit, error))


def _words(kind: str, limit: Any, error: Any) -> str:
    if kind == "type":
        return f"must be {_TYPES.get(limit, limit)}"
    comparisons = {
        "minimum": ">=",
        "maximum": "<=",
        "exclusiveMinimum": ">",
        "exclusiveMaximum": "<",
    }
    if kind in comparisons:
        return f"must be {comparisons[kind]} {limit}"
    if kind == "minLength":
        return "must not be empty" if limit == 1 else f"must be at least {limit} characters"
    if kind == "maxLength":
        return f"must be at most {limit} characters"
    if kind == "minItems":
        return f"must hold at least {limit} item{'s' if limit != 1 else ''}"
    if kind in ("maxItems", "maxProperties"):
        return f"must hold at most {limit} {'items' if kind == 'maxItems' else 'entries'}"
    if kind == "uniqueItems":
        return "holds the same value twice"
    if kind == "enum":
        return f"must be one of {', '.join(str(v) for v in limit)}"
    if kind == "contains" and "const" in limit:
        return f"must include {limit['const']}"
    if kind == "format":
        return _FORMAT_WORDS.get(limit, f"must be a {limit}")
    if kind == "pattern" and limit == "\\S":
        return "must not be blank"
    if kind in ("oneOf", "anyOf"):
        # Never the value itself: it may be a secret given where its name belongs.
        described = error.schema.get("description")
        return "is none of the forms allowed here" + (f": {described}" if described else "")
    return str(error.message)
