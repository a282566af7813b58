"""The worker's tools: the registry of installed tools and the demo tools.

The tool contract, the schema check, the effects port and the call path live in `tether.tools`
(the public package for tool authors) and are re-exported here. Tools are contributed by
`ToolProvider`s under the `tether.tools` entry-point group and executed through
`ToolRegistry.execute`, which hands each call to `tether.tools.path.execute`.
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
