"""Tool input checked against the tool's JSON Schema, which lives in `tether.tools.schema`;
re-exported here for the worker's modules."""

from tether.tools.schema import (
    InputSchema,
    SchemaError,
    Violation,
    check_schema,
    normalize,
    validate,
)

__all__ = ["InputSchema", "SchemaError", "Violation", "check_schema", "normalize", "validate"]
