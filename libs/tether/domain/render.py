"""A render: the first request an agent's attempt would send for a message in a new
conversation, built on a worker with no lease and no model call (what `tether agents render`
shows). The orchestrator asks with a `RenderJob` on a Work stream; the worker answers with a
`Rendered` of the same id."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tether.domain.agents import AgentConfig


@dataclass(frozen=True, slots=True)
class FoundDocument:
    """A document of the tenant matching the message, as the orchestrator's search found it."""

    document_id: str
    title: str
    text: str


@dataclass(frozen=True, slots=True)
class RenderJob:
    """What a worker is asked to render: the configuration a claim would resolve for the
    source and channel, and the new message."""

    render_id: int
    tenant_id: str
    config: AgentConfig
    message: str
    source: str = ""
    channel: str = ""
    actor_type: str = ""
    actor_id: str = ""
    documents: tuple[FoundDocument, ...] = ()


@dataclass(frozen=True, slots=True)
class Rendered:
    """A worker's answer: the Messages API request and its local estimate, or why it could not
    be built (`error_code` set: a required context provider failed)."""

    render_id: int
    request: dict[str, Any]
    estimated_input_tokens: int = 0
    estimated_cost_micros: int = 0
    error_code: str = ""
    error_message: str = ""
    warnings: tuple[str, ...] = ()
    """What the request leaves out and why, in a completion's warning words."""
