"""`make bench BENCH=tool_input`: the worker's check of a tool call's input (normalise, then
validate against the tool's input schema), in microseconds per call: a real tool's schema
(publish_post) and a richer one (nested objects, arrays, enums, bounds), each with a valid input
and one breaking three rules. In process, no services: this is what every tool call pays."""

from __future__ import annotations

import statistics
import timeit
from typing import Any

from bench.common import emit
from services.worker.tools.demo import PublishPost
from services.worker.tools.schema import InputSchema, normalize

# Enough calls per sample that the timer's resolution is noise, few enough to run in seconds.
CALLS = 2_000
SAMPLES = 7

RICH: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 40},
        "count": {"type": "integer", "minimum": 1, "maximum": 100},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "mode": {"enum": ["draft", "publish", "schedule"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}},
        "nested": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "note": {"type": ["string", "null"]}},
            "required": ["id"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "mode"],
    "additionalProperties": False,
}
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "publish_post_valid": (PublishPost.spec.input_schema, {"text": "Hello, world"}),
    "publish_post_invalid": (PublishPost.spec.input_schema, {"text": "", "extra": 1.0}),
    "rich_valid": (
        RICH,
        {
            "name": "report",
            "count": 3.0,
            "ratio": 0.5,
            "mode": "draft",
            "tags": ["a", "b", "c"],
            "nested": {"id": 7.0, "note": None},
        },
    ),
    "rich_invalid": (RICH, {"name": "r", "count": 0.0, "mode": "later", "tags": ["a", 1.0]}),
}


def _check(compiled: InputSchema, instance: dict[str, Any]) -> None:
    compiled.violations(normalize(compiled.schema, instance))


async def run() -> None:
    """Print one figure per case: the median over SAMPLES of the mean time of one check, the
    schema compiled once as the registry compiles it."""
    for case, (schema, instance) in CASES.items():
        compiled = InputSchema(schema)
        samples = timeit.repeat(
            lambda c=compiled, i=instance: _check(c, i), number=CALLS, repeat=SAMPLES
        )
        per_call_us = statistics.median(samples) / CALLS * 1e6
        emit(f"tool_input_{case}_us", round(per_call_us, 2), "us")
