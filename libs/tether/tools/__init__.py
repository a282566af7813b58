"""`tether.tools`: writing a tool for Tether, and the one path every tool call takes.

For authors: `@tool` (a tool from an async function, its schema from its type hints; on a method,
the class form), `ToolContext` (who calls, the idempotency key, the connections, the
cancellation), `ToolError` (an expected failure the model reads) and `ConnectionGap` (pause the run
until a person connects), `Toolkit` (what a package's `tether.tools` entry point names), and
`tether.testing.tools` to run a tool through the same path in a unit test.

For runtimes: `ToolDefinition` (a tool from any spec and handler), `ToolCalls` (the approval
gate, the connection pause and `tether.tools.path.execute`: validation, the effects record,
timeout, cancellation) with its ports `EffectsPort`, `Approvals`, `Consent` and
`ConnectionResolver`.

Importing this package never imports the worker (`services.*`).
"""

from tether.tools.base import (
    GATED_RISKS,
    Authorization,
    CallContext,
    ConnectionGap,
    ConnectionResolver,
    RiskCategory,
    Tool,
    ToolContext,
    ToolError,
    ToolOutput,
    ToolProvider,
    ToolSpec,
    UnsettledCall,
)
from tether.tools.calls import (
    ApprovalRequest,
    Approvals,
    Consent,
    Decision,
    Paused,
    ToolCalls,
)
from tether.tools.decorator import (
    FunctionTool,
    ToolDefinition,
    Toolkit,
    tool,
    tools_of,
)
from tether.tools.effects import EffectsPort, idempotency_key
from tether.tools.path import PreparedTool, ToolErrorCode, ToolResult

ENTRY_POINT_GROUP = "tether.tools"

__all__ = [
    "ENTRY_POINT_GROUP",
    "GATED_RISKS",
    "ApprovalRequest",
    "Approvals",
    "Authorization",
    "CallContext",
    "ConnectionGap",
    "ConnectionResolver",
    "Consent",
    "Decision",
    "EffectsPort",
    "FunctionTool",
    "Paused",
    "PreparedTool",
    "RiskCategory",
    "Tool",
    "ToolCalls",
    "ToolContext",
    "ToolDefinition",
    "ToolError",
    "ToolErrorCode",
    "ToolOutput",
    "ToolProvider",
    "ToolResult",
    "ToolSpec",
    "Toolkit",
    "UnsettledCall",
    "idempotency_key",
    "tool",
    "tools_of",
]
