"""Routing: the agent configuration an attempt runs with, resolved before the loop.

Defaults below, overridden per tenant by `tenants.agent` (JSON). The resolved configuration is
stored on the run at claim time, so an attempt's inputs are explicit and auditable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from tether.errors import InvalidArgument
from tether.pricing import DEFAULT_PRICES


@dataclass(frozen=True)
class Limits:
    """Per-run limits; each ends a run with its own classified reason."""

    max_steps: int = 8
    max_tool_calls: int = 16
    wall_clock_seconds: float = 300.0
    max_input_tokens: int = 1_000_000
    max_output_tokens: int = 100_000
    max_cost_micros: int = 5_000_000
    max_attempts: int = 3
    backoff_initial_seconds: float = 0.5
    backoff_max_seconds: float = 8.0
    max_inline_tool_output_bytes: int = 16_384
    max_tokens_per_turn: int = 4096


@dataclass(frozen=True)
class SystemBlock:
    """One structured system block; `cache_control` "ephemeral" marks a cache breakpoint."""

    text: str
    cache_control: str = ""


DEFAULT_PERSONA = (
    "You are Tether's demo agent. Answer briefly. Use tools when they help; ask before "
    "publishing anything."
)


@dataclass(frozen=True)
class AgentConfig:
    """Everything an attempt needs to know about its agent."""

    agent: str = "default"
    model: str = "claude-sonnet-5-5"
    system_prompt: str = DEFAULT_PERSONA
    system_blocks: tuple[SystemBlock, ...] = (SystemBlock(DEFAULT_PERSONA, "ephemeral"),)
    tool_allowlist: tuple[str, ...] = (
        "get_time",
        "publish_post",
        "calendar_list_events",
        "ask_questions",
        "request_approval",
    )
    limits: Limits = field(default_factory=Limits)
    prices: Mapping[str, Mapping[str, float]] = field(
        default_factory=lambda: {m: asdict(p) for m, p in DEFAULT_PRICES.items()}
    )

    def to_json(self) -> dict[str, Any]:
        """The stored form."""
        data = asdict(self)
        data["system_blocks"] = [asdict(b) for b in self.system_blocks]
        data["prices"] = {k: dict(v) for k, v in self.prices.items()}
        return data


def resolve(overrides: Mapping[str, Any]) -> AgentConfig:
    """The tenant's configuration: defaults with `overrides` (tenants.agent) applied."""
    base = AgentConfig()
    try:
        limits = replace(base.limits, **dict(overrides.get("limits", {})))
        blocks = tuple(SystemBlock(**b) for b in overrides.get("system_blocks", ())) or None
        prompt = overrides.get("system_prompt", base.system_prompt)
        return replace(
            base,
            agent=overrides.get("agent", base.agent),
            model=overrides.get("model", base.model),
            system_prompt=prompt,
            system_blocks=blocks or (SystemBlock(prompt, "ephemeral"),),
            tool_allowlist=tuple(overrides.get("tool_allowlist", base.tool_allowlist)),
            limits=limits,
            prices={**base.prices, **overrides.get("prices", {})},
        )
    except TypeError as exc:
        raise InvalidArgument(f"tenant agent configuration is invalid: {exc}") from exc
