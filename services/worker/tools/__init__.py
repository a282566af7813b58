"""The tool registry: tool contracts, the effects port, the registry itself, the demo tools.

Tools are contributed by `ToolProvider`s under the `tether.tools` entry-point group and executed
through `ToolRegistry.execute`, which validates input, guards external writes with the effects
record and an idempotency key, enforces timeouts and caps the inline output.
"""

from services.worker.tools.base import (
    CallContext,
    RiskCategory,
    Tool,
    ToolContext,
    ToolError,
    ToolOutput,
    ToolProvider,
    ToolSpec,
)
from services.worker.tools.effects import EffectsPort, idempotency_key
from services.worker.tools.registry import (
    ENTRY_POINT_GROUP,
    ToolErrorCode,
    ToolRegistry,
    ToolResult,
    truncate_inline,
)
from services.worker.tools.schema import (
    InputSchema,
    SchemaError,
    Violation,
    check_schema,
    normalize,
    validate,
)
from tether.domain import EffectState

__all__ = [
    "ENTRY_POINT_GROUP",
    "CallContext",
    "EffectState",
    "EffectsPort",
    "InputSchema",
    "RiskCategory",
    "SchemaError",
    "Tool",
    "ToolContext",
    "ToolError",
    "ToolErrorCode",
    "ToolOutput",
    "ToolProvider",
    "ToolRegistry",
    "ToolResult",
    "ToolSpec",
    "Violation",
    "check_schema",
    "idempotency_key",
    "normalize",
    "truncate_inline",
    "validate",
]
