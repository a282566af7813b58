"""An agent document: parsed, checked against the schema and the rules it cannot say,
normalised, and read as routing and approvals take it."""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, TypeGuard

from tether.agent_spec.loading import load
from tether.agent_spec.mcp import mcp_violations
from tether.agent_spec.routes import Route
from tether.agent_spec.validation import schema, violations
from tether.agent_spec.violations import Violation, pointer, refusal

# What tenants have had since before agents were documents: allow-always for a principal's own
# runs (interactions reads the same default from a tenant without a policy).
DEFAULT_ALWAYS_ALLOW_SCOPES = ("principal",)
MICROS_PER_USD = 1_000_000


@dataclass(frozen=True, slots=True)
class AgentSpec:
    """One accepted document: `written` as its author sent it, `normalised` its canonical
    form (keys sorted, numbers as the schema types them, `max_cost_usd` a decimal string),
    `routes` the runs it takes."""

    name: str
    written: str
    normalised: dict[str, Any]
    routes: tuple[Route, ...]

    @property
    def digest(self) -> str:
        """sha256 (hex) of the canonical normalised JSON: two applies of the same agent in
        any layout, key order or syntax (JSON or YAML) have the same digest."""
        return hashlib.sha256(canonical_json(self.normalised).encode("utf-8")).hexdigest()

    def overrides(self) -> dict[str, Any]:
        """The agent as `tenants.agent` overrides, which the orchestrator's routing resolves:
        only what the document says, so an absent field keeps routing's default."""
        # A copy: the caller may change what it gets, never this version's stored form.
        doc = copy.deepcopy(self.normalised)
        out: dict[str, Any] = {"agent": self.name}
        renamed = {"tools": "tool_allowlist", "instructions": "system_prompt"}
        for key in ("model", "instructions", "persona", "personas", "skills", "tools", "context"):
            if key in doc:
                out[renamed.get(key, key)] = doc[key]
        if "limits" in doc:
            limits = dict(doc["limits"])
            if "max_cost_usd" in limits:
                usd = Decimal(limits.pop("max_cost_usd"))
                limits["max_cost_micros"] = int(usd * MICROS_PER_USD)
            out["limits"] = limits
        if "prices" in doc:
            out["prices"] = doc["prices"]
        if "mcp_servers" in doc:
            out["mcp_servers"] = doc["mcp_servers"]
        if "delegation" in doc:
            out["delegation"] = doc["delegation"]
        # Always: a run of a document is approved by its document, never by the tenant's
        # policy of before agents, even when the document leaves every default in place.
        out["approvals"] = self.approvals()
        return out

    def approvals(self) -> dict[str, Any]:
        """The approval policy: `always_allow_scopes` (today's default when unsaid), and, as
        written, `ttl_seconds` and the per-`tools` and per-`risks` entries
        (`{decisions, ttl_seconds}`). What an entry leaves out is the next one's to say:
        `offered_decisions` and `approval_ttl_seconds` read it so."""
        policy: dict[str, Any] = copy.deepcopy(self.normalised.get("approvals", {}))
        policy.setdefault("always_allow_scopes", list(DEFAULT_ALWAYS_ALLOW_SCOPES))
        return policy


def offered_decisions(
    policy: Mapping[str, Any], tool: str, risk: str, decisions: tuple[str, ...]
) -> list[str]:
    """The decisions a person is offered on `tool` of category `risk`: the tool's entry, else
    the category's, else all of `decisions`; allow-always only where a scope permits it."""
    chosen = _entry(policy, tool, risk, "decisions") or list(decisions)
    scopes = policy.get("always_allow_scopes", DEFAULT_ALWAYS_ALLOW_SCOPES)
    return [d for d in chosen if d != "allow-always" or scopes]


def approval_ttl_seconds(policy: Mapping[str, Any], tool: str, risk: str, default: float) -> float:
    """How long an approval of `tool` of category `risk` waits: the tool's entry, else the
    category's, else the policy's, else `default` (the service's setting)."""
    ttl = _entry(policy, tool, risk, "ttl_seconds") or policy.get("ttl_seconds")
    return float(ttl) if ttl else default


def _entry(policy: Mapping[str, Any], tool: str, risk: str, key: str) -> Any:
    for kind, name in (("tools", tool), ("risks", risk)):
        entry = policy.get(kind, {}).get(name, {})
        if key in entry:
            return entry[key]
    return None


def parse(text: str | bytes) -> AgentSpec:
    """An accepted agent document, or InvalidArgument listing every violation (`/pointer:
    message`; details `{"violations": [{pointer, message}]}`). The size is checked before
    anything is parsed; JSON is tried first, then YAML."""
    data = load(text)
    found = [*violations(data), *_beyond_schema(data)]
    if found:
        raise refusal(found)
    normalised = _normalise(data, schema(), schema())
    routes = tuple(Route(**r) for r in normalised.get("routes", ()))
    written = text.decode("utf-8") if isinstance(text, bytes) else text
    return AgentSpec(normalised["name"], written, normalised, routes)


def canonical_json(data: Any) -> str:
    """The one text of a normalised document the digest is taken of."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _beyond_schema(doc: Any) -> Iterator[Violation]:
    """What the schema cannot say. Run beside the schema's check, so it reads only the parts
    of the right shape: a part of the wrong one is the schema's to report."""
    if not isinstance(doc, Mapping):
        return
    if "instructions" in doc and "persona" in doc:
        yield Violation("/instructions", "give either instructions or a persona, not both")
    for kind in ("personas", "skills"):
        names = [b.get("name") if isinstance(b, Mapping) else None for b in _list(doc, kind)]
        yield from _repeats(kind, names, "name")
    routes = [
        (r.get("source"), r.get("channel")) if isinstance(r, Mapping) else None
        for r in _list(doc, "routes")
    ]
    yield from _repeats("routes", routes, "")
    yield from mcp_violations(doc)
    limits = _map(doc, "limits")
    initial, most = limits.get("backoff_initial_seconds"), limits.get("backoff_max_seconds")
    if _is_number(initial) and _is_number(most) and initial > most:
        yield Violation(
            "/limits/backoff_initial_seconds", f"must be <= backoff_max_seconds ({most})"
        )
    approvals = _map(doc, "approvals")
    if approvals.get("always_allow_scopes") == []:
        for kind in ("tools", "risks"):
            for name, entry in _map(approvals, kind).items():
                if isinstance(entry, Mapping) and "allow-always" in _list(entry, "decisions"):
                    yield Violation(
                        pointer(["approvals", kind, name, "decisions"]),
                        "offers allow-always, which always_allow_scopes [] permits nowhere",
                    )


def _map(doc: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = doc.get(key)
    return value if isinstance(value, Mapping) else {}


def _list(doc: Mapping[str, Any], key: str) -> list[Any]:
    value = doc.get(key)
    return value if isinstance(value, list) else []


def _is_number(value: Any) -> TypeGuard[int | Decimal]:
    return isinstance(value, int | Decimal) and not isinstance(value, bool)


def _repeats(kind: str, values: list[Any], field: str) -> Iterator[Violation]:
    first: dict[Any, int] = {}
    for index, value in enumerate(values):
        try:
            hash(value)
        except TypeError:  # a part of the wrong shape: the schema reports it
            continue
        if value is None:
            continue
        if value in first:
            where = pointer([kind, index, field] if field else [kind, index])
            yield Violation(where, f"repeats /{kind}/{first[value]}")
        else:
            first[value] = index


def _normalise(value: Any, node: Mapping[str, Any], root: Mapping[str, Any]) -> Any:
    """`value` (accepted by `node`) in canonical form: keys sorted, numbers as typed."""
    while "$ref" in node:
        extra = {k: v for k, v in node.items() if k != "$ref"}
        node = {**_defined(root, node["$ref"]), **extra}
    if isinstance(value, dict):
        properties = node.get("properties", {})
        rest = node.get("additionalProperties")
        return {
            key: _normalise(value[key], properties.get(key, rest or {}), root)
            for key in sorted(value)
        }
    if isinstance(value, list):
        return [_normalise(item, node.get("items", {}), root) for item in value]
    if isinstance(value, bool) or not isinstance(value, int | Decimal):
        return value
    if node.get("format") == "usd":
        return format(Decimal(value).normalize(), "f")
    if node.get("type") == "integer":
        return int(value)
    return float(value)


def _defined(root: Mapping[str, Any], ref: str) -> Mapping[str, Any]:
    prefix = "#/$defs/"
    if not ref.startswith(prefix):
        raise ValueError(f"the agent schema refers outside itself: {ref}")
    found: Mapping[str, Any] = root["$defs"][ref.removeprefix(prefix)]
    return found
