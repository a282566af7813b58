"""What routing decides for an attempt: the agent it runs as (model, system prompt and blocks,
tools, limits, prices). The orchestrator resolves it at claim time and stores it on the run; the
worker receives it with the lease. 0 or empty means "not set": each use says what stands in."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from tether.pricing import Price


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-run limits; each ends a run with its own classified reason."""

    max_steps: int = 0
    max_tool_calls: int = 0
    wall_clock_seconds: float = 0.0
    max_input_tokens: int = 0
    max_output_tokens: int = 0
    max_cost_micros: int = 0
    max_attempts: int = 0
    backoff_initial_seconds: float = 0.0
    backoff_max_seconds: float = 0.0
    max_inline_tool_output_bytes: int = 0
    max_tokens_per_turn: int = 0


@dataclass(frozen=True, slots=True)
class SystemBlock:
    """One structured system block; `cache_control` ("ephemeral") marks a cache breakpoint."""

    text: str
    cache_control: str = ""


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """The agent an attempt runs as."""

    model: str
    agent: str = ""
    system_prompt: str = ""
    system_blocks: tuple[SystemBlock, ...] = ()
    tool_allowlist: tuple[str, ...] = ()
    limits: Limits = Limits()
    prices: Mapping[str, Price] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The stored form (`runs.config`)."""
        return {
            "agent": self.agent,
            "model": self.model,
            "system_prompt": self.system_prompt,
            "system_blocks": [asdict(b) for b in self.system_blocks],
            "tool_allowlist": list(self.tool_allowlist),
            "limits": asdict(self.limits),
            "prices": {model: asdict(price) for model, price in self.prices.items()},
        }
