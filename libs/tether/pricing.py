"""Prices model turns. Each turn is priced at its own model's rate, never a run's total at the
last model's rate; prices come from configuration (they change often)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Price:
    """US dollars per million tokens."""

    input: float
    output: float
    cache_write: float
    cache_read: float


# Defaults from the provider's published tables (reference/anthropic-wire-facts.md, § 5);
# tenants override them in their agent configuration.
DEFAULT_PRICES: dict[str, Price] = {
    "claude-opus-5-5": Price(4.0, 20.0, 5.0, 0.20),
    "claude-sonnet-5-5": Price(2.0, 10.0, 2.50, 0.20),
    "claude-haiku-5-5": Price(0.10, 0.50, 0.125, 0.01),
    "claude-opus-5": Price(5.0, 25.0, 6.25, 0.50),
    "claude-sonnet-5": Price(2.0, 10.0, 2.50, 0.20),
}


# The token counts a model turn reports, by their stored names.
TOKEN_FIELDS = (
    "input_tokens",
    "output_tokens",
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
)


def cost_micros(usage: Mapping[str, Any], price: Price | None) -> int:
    """Cost of one turn in micro-dollars (0 for a model without a known price)."""
    if price is None:
        return 0
    dollars_per_million = (
        int(usage.get("input_tokens", 0)) * price.input
        + int(usage.get("output_tokens", 0)) * price.output
        + int(usage.get("cache_creation_input_tokens", 0)) * price.cache_write
        + int(usage.get("cache_read_input_tokens", 0)) * price.cache_read
    )
    # tokens * $/M tokens = micro-dollars exactly; round to the nearest micro-dollar.
    return round(dollars_per_million)


def add_usage(total: Mapping[str, Any], turn: Mapping[str, Any]) -> dict[str, Any]:
    """`total` plus one priced `turn` (both in their stored JSON form)."""
    out = {k: int(total.get(k, 0)) + int(turn.get(k, 0)) for k in TOKEN_FIELDS}
    out["cost_micros"] = int(total.get("cost_micros", 0)) + int(turn.get("cost_micros", 0))
    return out
