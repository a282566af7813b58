"""Routing: the agent configuration an attempt runs with, resolved before the loop.

Defaults below, overridden per tenant by `tenants.agent` (JSON). The resolved configuration is
stored on the run at claim time, so an attempt's inputs are explicit and auditable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from tether.domain import AgentConfig, Limits, SystemBlock
from tether.errors import InvalidArgument
from tether.pricing import DEFAULT_PRICES, Price

DEFAULT_PERSONA = (
    "You are Tether's demo agent. Answer briefly. Use tools when they help; ask before "
    "publishing anything."
)

# What a tenant's agent is until its configuration (`tenants.agent`) says otherwise.
DEFAULT = AgentConfig(
    agent="default",
    model="claude-sonnet-5-5",
    system_prompt=DEFAULT_PERSONA,
    system_blocks=(SystemBlock(DEFAULT_PERSONA, "ephemeral"),),
    tool_allowlist=(
        "get_time",
        "publish_post",
        "calendar_list_events",
        "ask_questions",
        "request_approval",
    ),
    limits=Limits(
        max_steps=8,
        max_tool_calls=16,
        wall_clock_seconds=300.0,
        max_input_tokens=1_000_000,
        max_output_tokens=100_000,
        max_cost_micros=5_000_000,
        max_attempts=3,
        backoff_initial_seconds=0.5,
        backoff_max_seconds=8.0,
        max_inline_tool_output_bytes=16_384,
        max_tokens_per_turn=4096,
    ),
    prices=DEFAULT_PRICES,
)


def resolve(overrides: Mapping[str, Any]) -> AgentConfig:
    """The tenant's configuration: defaults with `overrides` (tenants.agent) applied."""
    base = DEFAULT
    try:
        limits = replace(base.limits, **dict(overrides.get("limits", {})))
        prices = {m: Price(**p) for m, p in overrides.get("prices", {}).items()}
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
            prices={**base.prices, **prices},
        )
    except TypeError as exc:
        raise InvalidArgument(f"tenant agent configuration is invalid: {exc}") from exc
