"""Routing: the agent configuration an attempt runs with, resolved before the loop.

Defaults below, overridden per tenant by `tenants.agent` (JSON), and picked per run by where it
came from (its source and channel): the persona is the first of the tenant's `personas` that
applies to the run (else its `persona`, else the built-in one), the skills are every one of the
tenant's `skills` that applies, and the tool allowlist is the agent's tools with theirs added.
The first claim of a run stores the decision and names it on the run; later attempts run with
that one (see `claims`). The keys of `tenants.agent`:

| key | what |
|---|---|
| `agent`, `model` | the agent's name, its model |
| `persona` | the default persona: `{name, version, instructions, tools}` |
| `personas` | personas for some sources or channels: each also `sources`, `channels` |
| `skills` | enabled skills: `{name, version, instructions, tools, sources, channels}` |
| `tool_allowlist` | the agent's own tools |
| `context` | what the context holds (`tether.domain.ContextPolicy`'s fields) |
| `limits`, `prices` | `Limits` fields and `max_running` (runs at once); prices by model |
| `system_prompt` | the persona's instructions, as configured before personas (name `custom`) |
| `approvals` | an agent document's approval policy (`AgentSpec.approvals()`); unset, the tenant's |
| `mcp_servers` | an agent document's MCP servers, as it writes them (`tether.domain.McpServer`) |
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any
from zoneinfo import ZoneInfo

from tether.agent_spec import canonical_json
from tether.domain import (
    DEFAULT_BACKOFF_INITIAL_S,
    DEFAULT_BACKOFF_MAX_S,
    DEFAULT_MAX_WAIT_S,
    AgentConfig,
    Limits,
    SystemBlock,
)
from tether.domain.agents import Bundle, ContextPolicy, Delegation, McpServer, merged_tools
from tether.errors import InvalidArgument
from tether.ids import is_identifier
from tether.pricing import DEFAULT_PRICES, Price

DEFAULT_PERSONA = (
    "You are Tether's demo agent. Answer briefly. Use tools when they help; ask before "
    "publishing anything."
)

# What a bundle may hold: enough for detailed instructions, small enough that a tenant's
# personas and skills cannot crowd the model's context out.
MAX_INSTRUCTIONS_CHARS = 32_000
MAX_SKILLS = 16
MAX_BUNDLE_TOOLS = 64
MAX_VERSION = 1_000_000
CACHE_TTLS = ("5m", "1h")

BUILTIN_PERSONA = Bundle("tether-demo", 1, DEFAULT_PERSONA)

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
        backoff_initial_seconds=DEFAULT_BACKOFF_INITIAL_S,
        backoff_max_seconds=DEFAULT_BACKOFF_MAX_S,
        max_inline_tool_output_bytes=16_384,
        max_tokens_per_turn=4096,
        max_wait_seconds=DEFAULT_MAX_WAIT_S,
    ),
    prices=DEFAULT_PRICES,
    persona=BUILTIN_PERSONA,
    context=ContextPolicy(
        live_facts=("channel", "actor", "time"),
        retriever="documents",
        knowledge_documents=3,
        knowledge_chars=2000,
    ),
)


def resolve(overrides: Mapping[str, Any], source: str = "", channel: str = "") -> AgentConfig:
    """The configuration of a run from `source` on `channel` of a tenant whose agent is
    `overrides` (tenants.agent): the defaults with it applied, persona and skills picked.
    InvalidArgument names what is wrong with a broken configuration."""
    base = DEFAULT
    # The cap on runs at once is the claim's, not the attempt's (`AgentConfig.max_running`).
    limited = dict(overrides.get("limits", {}))
    max_running = limited.pop("max_running", 0)
    if not isinstance(max_running, int) or isinstance(max_running, bool) or max_running < 0:
        raise InvalidArgument(
            "tenant agent configuration is invalid: limits.max_running must be a whole number "
            "of runs (0: no cap)"
        )
    try:
        limits = replace(base.limits, **limited)
        prices = {m: Price(**p) for m, p in overrides.get("prices", {}).items()}
        context = _context(overrides.get("context", {}), base.context)
    except TypeError as exc:
        raise InvalidArgument(f"tenant agent configuration is invalid: {exc}") from exc
    persona = _persona(overrides, source, channel)
    skills = [
        s for s in _bundles(overrides.get("skills", ()), "skills") if s.applies(source, channel)
    ]
    blocks = [persona.instructions, *(s.instructions for s in skills)]
    model = overrides.get("model", base.model)
    if not isinstance(model, str) or not model:
        raise InvalidArgument("tenant agent configuration is invalid: model must be a name")
    return replace(
        base,
        agent=str(overrides.get("agent", base.agent)),
        model=model,
        system_prompt="\n\n".join(blocks),
        # One breakpoint, on the last block: the stable prefix is tools, persona and skills.
        system_blocks=tuple(
            SystemBlock(text, "ephemeral" if i == len(blocks) - 1 else "")
            for i, text in enumerate(blocks)
        ),
        tool_allowlist=merged_tools(
            _names(overrides.get("tool_allowlist", base.tool_allowlist), "tool_allowlist"),
            persona.tools,
            *(s.tools for s in skills),
        ),
        limits=limits,
        prices={**base.prices, **prices},
        persona=persona,
        skills=tuple(skills),
        context=context,
        approvals=_approvals(overrides.get("approvals")),
        mcp_servers=_mcp_servers(overrides.get("mcp_servers", ())),
        max_running=max_running,
        delegation=_delegation(overrides.get("delegation")),
    )


def _delegation(raw: Any) -> Delegation | None:
    """An agent document's `delegation` (checked when it was applied)."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise _invalid("delegation must be a map")
    return Delegation.from_json(raw)


def _approvals(policy: Any) -> str:
    """A document's approval policy as the canonical text the run carries; "" for none."""
    if policy is None:
        return ""
    if not isinstance(policy, Mapping):
        raise InvalidArgument("tenant agent configuration is invalid: approvals must be a map")
    return canonical_json(policy)


def _mcp_servers(raw: Any) -> tuple[McpServer, ...]:
    """The MCP servers an agent document names (checked when it was applied)."""
    if not isinstance(raw, Sequence) or isinstance(raw, str):
        raise InvalidArgument("tenant agent configuration is invalid: mcp_servers must be a list")
    try:
        return tuple(McpServer.from_json(entry) for entry in raw)
    except (KeyError, TypeError, AttributeError) as exc:
        raise InvalidArgument(
            f"tenant agent configuration is invalid: an mcp_servers entry lacks {exc}"
        ) from exc


def _persona(overrides: Mapping[str, Any], source: str, channel: str) -> Bundle:
    for persona in _bundles(overrides.get("personas", ()), "personas"):
        if persona.applies(source, channel):
            return persona
    if "persona" in overrides:
        return _bundle(overrides["persona"], "persona")
    if "system_prompt" in overrides:
        prompt = overrides["system_prompt"]
        return _bundle({"name": "custom", "version": 1, "instructions": prompt}, "system_prompt")
    return BUILTIN_PERSONA


def _bundles(raw: Any, what: str) -> list[Bundle]:
    if not isinstance(raw, Sequence) or isinstance(raw, str):
        raise _invalid(f"{what} must be a list of bundles")
    if len(raw) > MAX_SKILLS:
        raise _invalid(f"{what} holds {len(raw)} bundles; the limit is {MAX_SKILLS}")
    bundles = [_bundle(item, f"{what}[{i}]") for i, item in enumerate(raw)]
    names = [b.name for b in bundles]
    if len(set(names)) != len(names):
        raise _invalid(f"{what} names a bundle twice")
    return bundles


def _bundle(raw: Any, what: str) -> Bundle:
    if not isinstance(raw, Mapping):
        raise _invalid(f"{what} must be an object with name, version and instructions")
    unknown = sorted(set(raw) - {"name", "version", "instructions", "tools", "sources", "channels"})
    if unknown:
        raise _invalid(f"{what} has unknown field(s) {', '.join(unknown)}")
    name, version, instructions = raw.get("name"), raw.get("version"), raw.get("instructions")
    if not isinstance(name, str) or not is_identifier(name):
        raise _invalid(f"{what}.name must be an identifier")
    if isinstance(version, bool) or not isinstance(version, int) or not 0 < version <= MAX_VERSION:
        raise _invalid(f"{what}.version must be an integer from 1 to {MAX_VERSION}")
    if not isinstance(instructions, str) or not instructions.strip():
        raise _invalid(f"{what}.instructions must be non-empty text")
    if len(instructions) > MAX_INSTRUCTIONS_CHARS:
        raise _invalid(
            f"{what}.instructions is {len(instructions)} characters; the limit is "
            f"{MAX_INSTRUCTIONS_CHARS}"
        )
    return Bundle(
        name,
        version,
        instructions,
        tools=_names(raw.get("tools", ()), f"{what}.tools"),
        sources=_names(raw.get("sources", ()), f"{what}.sources"),
        channels=_names(raw.get("channels", ()), f"{what}.channels"),
    )


def _names(raw: Any, what: str) -> tuple[str, ...]:
    if not isinstance(raw, Sequence) or isinstance(raw, str):
        raise _invalid(f"{what} must be a list of names")
    if len(raw) > MAX_BUNDLE_TOOLS:
        raise _invalid(f"{what} holds {len(raw)} names; the limit is {MAX_BUNDLE_TOOLS}")
    for name in raw:
        if not isinstance(name, str) or not is_identifier(name):
            raise _invalid(f"{what} holds {name!r}, which is not a name")
    return tuple(raw)


def _context(raw: Any, base: ContextPolicy) -> ContextPolicy:
    if not isinstance(raw, Mapping):
        raise _invalid("context must be an object")
    policy = replace(base, **dict(raw))
    if "live_facts" in raw:
        policy = replace(policy, live_facts=_names(raw["live_facts"], "context.live_facts"))
    for name in ("budget_tokens", "knowledge_documents", "knowledge_chars"):
        value = getattr(policy, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _invalid(f"context.{name} must be a whole number, 0 or more")
    if policy.retriever and not is_identifier(policy.retriever):
        raise _invalid("context.retriever must be a name, or empty for none")
    if policy.compaction_model and not isinstance(policy.compaction_model, str):
        raise _invalid("context.compaction_model must be a model name")
    if policy.cache_ttl not in CACHE_TTLS:
        raise _invalid(f"context.cache_ttl must be one of {', '.join(CACHE_TTLS)}")
    try:
        ZoneInfo(policy.timezone)
    except (ValueError, KeyError, TypeError) as exc:
        raise _invalid(f"context.timezone {policy.timezone!r} is not a known time zone") from exc
    return policy


def _invalid(message: str) -> InvalidArgument:
    return InvalidArgument(f"tenant agent configuration is invalid: {message}")
