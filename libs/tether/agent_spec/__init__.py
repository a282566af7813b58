"""Agents as documents: an agent's one version as its author writes it (JSON or YAML), checked
against `agent.schema.json` and the rules the schema cannot say, normalised, and read as routing
(`AgentSpec.overrides`) and approvals (`AgentSpec.approvals`) take it; which agent takes a run
(`pick`), and which agents claim the same runs (`route_conflicts`). No protobuf and no service
here: the orchestrator, the gateway and the CLI all read documents through this package."""

from tether.agent_spec.document import (
    DEFAULT_ALWAYS_ALLOW_SCOPES,
    AgentSpec,
    approval_ttl_seconds,
    canonical_json,
    offered_decisions,
    parse,
)
from tether.agent_spec.legacy import from_overrides
from tether.agent_spec.loading import MAX_DEPTH, MAX_DOCUMENT_BYTES
from tether.agent_spec.references import tool_references, unpriced_models
from tether.agent_spec.routes import SOURCES, Route, pick, route_conflicts
from tether.agent_spec.validation import schema
from tether.agent_spec.violations import Violation

__all__ = [
    "DEFAULT_ALWAYS_ALLOW_SCOPES",
    "MAX_DEPTH",
    "MAX_DOCUMENT_BYTES",
    "SOURCES",
    "AgentSpec",
    "Route",
    "Violation",
    "approval_ttl_seconds",
    "canonical_json",
    "from_overrides",
    "offered_decisions",
    "parse",
    "pick",
    "route_conflicts",
    "schema",
    "tool_references",
    "unpriced_models",
]
