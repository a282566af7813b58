"""The built-in `delegate` tool: what it offers the model (only to an agent whose document's
`delegation` allows it), the one check of its input, and the words the model reads of a child's
end.

A delegation never holds a worker: the call is made durable, the orchestrator starts the child
run (one per call, however often the call is issued: `services.orchestrator.children`), and once
every call of the turn has its child the attempt raises Parked (waiting-for-children). The
orchestrator queues the parent again when all of them have ended; the resumed attempt issues the
calls again, each answered by its child's answer, or by its failure as a tool error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tether.domain import AgentConfig, Delegation, RunError
from tether.states import RunStatus

DELEGATE = "delegate"

# A message to a child is its run's input: the limit of an admitted message's text.
MAX_MESSAGE_CHARS = 32_000


def delegate_spec(delegation: Delegation) -> dict[str, Any]:
    """The tool as the model sees it: the agents it may hand work to, by name."""
    return {
        "name": DELEGATE,
        "description": (
            "Hand a task to another agent: it runs as a child run of this one, with its own "
            "conversation, and its answer is this call's result. Several delegate calls in one "
            "turn run their children at once; this run waits, holding no worker, until all of "
            "them have ended. Give `agent` (one of: "
            + ", ".join(delegation.agents)
            + ") and `message` (everything the agent needs to know: it sees nothing else)."
        ),
        "input_schema": {
            "type": "object",
            "properties": {
                "agent": {"type": "string", "enum": list(delegation.agents)},
                "message": {"type": "string"},
            },
            "required": ["agent", "message"],
        },
    }


def delegate_specs(config: AgentConfig) -> list[dict[str, Any]]:
    """The `delegate` tool when the agent's document allows delegation, else none."""
    return [] if config.delegation is None else [delegate_spec(config.delegation)]


class DelegateRefused(Exception):
    """A `delegate` input the model must correct; the message says how."""


def delegate_input(input: Mapping[str, Any], delegation: Delegation) -> tuple[str, str]:
    """The (agent, message) of a `delegate` call; DelegateRefused when the agent is not one the
    document allows or the message is missing, empty or too long."""
    agent, message = input.get("agent"), input.get("message")
    allowed = ", ".join(delegation.agents)
    if not isinstance(agent, str) or not agent:
        raise DelegateRefused(f"give `agent`, one of: {allowed}")
    if agent not in delegation.agents:
        raise DelegateRefused(
            f"this agent may not delegate to {agent!r}; it may delegate to: {allowed}"
        )
    if not isinstance(message, str) or not message.strip():
        raise DelegateRefused("give `message`: the task, with everything the agent needs")
    if len(message) > MAX_MESSAGE_CHARS:
        raise DelegateRefused(f"`message` may be at most {MAX_MESSAGE_CHARS} characters")
    return agent, message


@dataclass(frozen=True, slots=True)
class Child:
    """A delegate call's child run as the orchestrator answered it."""

    run_id: str
    status: RunStatus
    result_text: str
    error: RunError | None
    created: bool = False
    # Whether the run parked waiting for its children when this child was started.
    parked: bool = False

    @property
    def ended(self) -> bool:
        return self.status.terminal


def child_result(child: Child) -> tuple[str, bool, str]:
    """A delegate call's result once its child ended: (content, is_error, error code)."""
    if child.status is RunStatus.COMPLETED:
        return child.result_text, False, ""
    why = child.error.message if child.error is not None else child.status.value
    code = "child_cancelled" if child.status is RunStatus.CANCELLED else "child_failed"
    return f"the child run {child.run_id} {child.status.value}: {why}", True, code
