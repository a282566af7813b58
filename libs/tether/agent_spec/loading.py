"""From text to plain data, safely: the size first, then JSON, else YAML that can neither run a
tag's constructor nor grow past its own size through aliases, and no value PostgreSQL or JSON
cannot hold. Non-integral numbers come out as `Decimal`, so a cost keeps its exact digits; the
schema then says what each one must be."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from datetime import date
from decimal import Decimal
from typing import Any

import yaml

from tether.agent_spec.violations import Violation, pointer, refusal, refuse
from tether.limits import AGENT_DOCUMENT_BYTES

# One size for the document, wherever it is checked (the gateway's request limits too).
MAX_DOCUMENT_BYTES = AGENT_DOCUMENT_BYTES
# The document's deepest legitimate path is five levels (/approvals/tools/x/decisions/0);
# anything far deeper is an attack on the parsers' recursion, refused before it recurses.
MAX_DEPTH = 16

# Strings never carry NUL (PostgreSQL text and JSONB refuse it) or lone surrogates (not Unicode).
_SURROGATE = re.compile("[\ud800-\udfff]")


def load(text: str | bytes) -> Any:
    """The document's data; InvalidArgument if it is too big, not UTF-8, or not JSON or YAML
    this module accepts."""
    size = len(text) if isinstance(text, bytes) else len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_DOCUMENT_BYTES:
        raise refuse("", f"the document is {size} bytes; the limit is {MAX_DOCUMENT_BYTES}")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise refuse("", f"the document is not UTF-8 text ({exc.reason})") from exc
    if "\x00" in text:
        raise refuse("", "the document holds a NUL byte")
    try:
        try:
            data = json.loads(
                text,
                parse_float=Decimal,
                parse_constant=_refuse_constant,
                object_pairs_hook=_unique_keys,
            )
        except json.JSONDecodeError:
            data = _load_yaml(text)
    except RecursionError as exc:
        raise refuse("", f"the document nests deeper than {MAX_DEPTH} levels") from exc
    except ValueError as exc:
        # int() refusing a number of thousands of digits, in either parser.
        raise refuse("", f"the document holds an unreadable value: {exc}") from exc
    _check_depth(data)
    problems = list(_problems(data, []))
    if problems:
        raise refusal(problems)
    return _exact_numbers(data)


def _refuse_constant(name: str) -> Any:
    raise refuse("", f"{name} is not a number a document may hold")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            # A parser keeping the last of two would silently drop what the author wrote first.
            raise refuse("", f"the key {key!r} appears twice in one object")
        data[key] = value
    return data


class _StrictLoader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML ships no type hints
    """SafeLoader refusing every tag (even the standard ones: the document is plain data) and
    every alias (the only way YAML grows past its text), and counting depth as it composes."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        mark = f"line {event.start_mark.line + 1}"
        if isinstance(event, yaml.AliasEvent):
            raise refuse("", f"YAML aliases are not accepted ({mark})")
        if getattr(event, "tag", None) is not None:
            raise refuse("", f"YAML tags are not accepted ({event.tag} at {mark})")
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise refuse("", f"the document nests deeper than {MAX_DEPTH} levels")
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise refuse(
                    "", f"YAML merge keys are not accepted (line {key_node.start_mark.line + 1})"
                )
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, str | int | float | bool) or key is None:
                if key in seen:
                    raise refuse("", f"the key {key!r} appears twice in one object")
                seen.add(key)
        return super().construct_mapping(node, deep)


def _load_yaml(text: str) -> Any:
    loader = _StrictLoader(text)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        raise refuse("", f"the document is neither JSON nor YAML: {_first_line(exc)}") from exc
    finally:
        loader.dispose()


def _first_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def _check_depth(data: Any) -> None:
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise refuse("", f"the document nests deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


def _problems(value: Any, path: list[str | int]) -> Iterator[Violation]:
    here = pointer(path)
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                yield Violation(here, f"the key {key!r} is not text; quote it")
                continue
            yield from _text_problems(pointer([*path, key]), key, "its key")
            yield from _problems(item, [*path, key])
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _problems(item, [*path, index])
    elif isinstance(value, str):
        yield from _text_problems(here, value, "it")
    elif isinstance(value, float) and not math.isfinite(value):
        yield Violation(here, "must be a finite number")
    elif isinstance(value, date):
        yield Violation(here, "is a YAML date; quote it to make it text")
    elif not isinstance(value, bool | int | float | Decimal) and value is not None:
        yield Violation(here, f"holds a {type(value).__name__}, which JSON cannot")


def _text_problems(here: str, text: str, what: str) -> Iterator[Violation]:
    if "\x00" in text:
        yield Violation(here, f"{what} holds a NUL character")
    if _SURROGATE.search(text):
        yield Violation(here, f"{what} holds a lone surrogate, which is not Unicode")


def _exact_numbers(value: Any) -> Any:
    # YAML reads 0.1 as the nearest double; its shortest repr is the digits the author wrote.
    if isinstance(value, dict):
        return {k: _exact_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_exact_numbers(v) for v in value]
    if isinstance(value, float):
        return Decimal(repr(value))
    return value
