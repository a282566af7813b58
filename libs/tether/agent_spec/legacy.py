"""Today's agent configuration (`tenants.agent`, with `tenants.policy`'s allow-always scopes) as
a document: the migration stores it as version 1 of the tenant's `default` agent."""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from tether.agent_spec.document import MICROS_PER_USD
from tether.agent_spec.validation import schema

# tenants.agent keys that keep their name in a document.
_SAME = ("model", "persona", "personas", "skills", "context", "prices")


def from_overrides(
    name: str, overrides: Mapping[str, Any], policy: Mapping[str, Any]
) -> dict[str, Any]:
    """`overrides` (tenants.agent) and `policy` (tenants.policy) as the document of an agent
    named `name`, resolving as `overrides` does today, but for two limits a document cannot
    hold: a limit of 0 (unset, which each use reads as no limit or a fallback of its own) is
    left out, so routing's default applies; a limit beyond the schema's maximum is brought down
    to it. A configuration routing refuses today gives a document `parse` refuses."""
    doc: dict[str, Any] = {"name": name}
    doc.update({key: overrides[key] for key in _SAME if key in overrides})
    if "system_prompt" in overrides and "persona" not in overrides:
        # Routing reads system_prompt only without a persona, as the persona `custom`.
        doc["instructions"] = overrides["system_prompt"]
    if "tool_allowlist" in overrides:
        doc["tools"] = overrides["tool_allowlist"]
    if "limits" in overrides:
        doc["limits"] = _limits(overrides["limits"])
    if "always_allow_scopes" in policy:
        doc["approvals"] = {"always_allow_scopes": policy["always_allow_scopes"]}
    return doc


def _limits(limits: Mapping[str, Any]) -> dict[str, Any]:
    bounds = schema()["$defs"]["limits"]["properties"]
    out: dict[str, Any] = {}
    for key, value in limits.items():
        if key == "max_cost_micros":
            key, value = "max_cost_usd", _usd(value)
        if isinstance(value, int | float) and not isinstance(value, bool):
            if value == 0:
                continue
            value = min(value, bounds.get(key, {}).get("maximum", value))
        out[key] = value
    return out


def _usd(micros: Any) -> Any:
    if isinstance(micros, bool) or not isinstance(micros, int):
        return micros
    # A float's shortest repr of micros / 10**6 is its exact decimal: a cost has at most 12
    # significant digits below the schema's maximum, within the 15 a double holds exactly.
    return float(Decimal(micros) / MICROS_PER_USD)
