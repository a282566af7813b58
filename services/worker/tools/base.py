"""The tool contract, which lives in `tether.tools.base` (the public package for tool authors);
re-exported here for the worker's modules."""

from tether.tools.base import (
    GAP_MESSAGES,
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
)

__all__ = [
    "GAP_MESSAGES",
    "GATED_RISKS",
    "Authorization",
    "CallContext",
    "ConnectionGap",
    "ConnectionResolver",
    "RiskCategory",
    "Tool",
    "ToolContext",
    "ToolError",
    "ToolOutput",
    "ToolProvider",
    "ToolSpec",
]
