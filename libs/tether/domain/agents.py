"""What routing decides for an attempt: the agent it runs as (model, persona and skills, system
blocks, tools, what its context holds, limits, prices). The orchestrator resolves it when a run
is first leased and pins it on the run (`routings`, `runs.routing_id`): every later attempt, a
resume days later included, runs with what the run started with. The worker receives it with
the lease. 0 or empty means "not set": each use says what stands in."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from tether.pricing import Price

DEFAULT_BACKOFF_INITIAL_S = 0.5
"""Seconds before a run's first retry when its limits set none: the Anthropic SDK's
`INITIAL_RETRY_DELAY`, so a run retried by Tether waits as one retried by the SDK."""

DEFAULT_BACKOFF_MAX_S = 8.0
"""Cap on a run's exponential retry backoff when its limits set none (the SDK's
`MAX_RETRY_DELAY`)."""


DEFAULT_MAX_WAIT_S = 7 * 24 * 3600.0
"""The longest `wait_until` a run may ask for when its limits set none: a week, long enough for
"check again on Monday", short enough that a forgotten timer does not outlive its reason."""


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
    # The longest wait one `wait_until` call may ask for (0: DEFAULT_MAX_WAIT_S).
    max_wait_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class SystemBlock:
    """One structured system block; `cache_control` ("ephemeral") marks a cache breakpoint."""

    text: str
    cache_control: str = ""


@dataclass(frozen=True, slots=True)
class Bundle:
    """A named, versioned bundle of instructions and tools a tenant enables: a persona (who the
    agent is) or a skill (what it knows how to do). `sources` and `channels` say where it
    applies; empty applies everywhere."""

    name: str
    version: int
    instructions: str
    tools: tuple[str, ...] = ()
    sources: tuple[str, ...] = ()
    channels: tuple[str, ...] = ()

    def applies(self, source: str, channel: str) -> bool:
        """Whether the bundle is for a run from `source` on `channel`."""
        return (not self.sources or source in self.sources) and (
            not self.channels or channel in self.channels
        )

    @property
    def ref(self) -> str:
        """`name@version`, as a run's routing shows it."""
        return f"{self.name}@{self.version}"

    def to_json(self) -> dict[str, Any]:
        """The stored form."""
        return {
            "name": self.name,
            "version": self.version,
            "instructions": self.instructions,
            "tools": list(self.tools),
            "sources": list(self.sources),
            "channels": list(self.channels),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Bundle:
        """What `to_json` stored."""
        return cls(
            name=str(data["name"]),
            version=int(data["version"]),
            instructions=str(data["instructions"]),
            tools=tuple(data.get("tools", ())),
            sources=tuple(data.get("sources", ())),
            channels=tuple(data.get("channels", ())),
        )


@dataclass(frozen=True, slots=True)
class ContextPolicy:
    """What an attempt's context holds beyond persona, skills and history, and how big it may
    grow. `budget_tokens` 0 never compacts; `compaction_model` "" summarises with the run's own
    model. `live_facts` and `retriever` name the providers the worker runs (the `tether.facts`
    and `tether.retrievers` entry points); `timezone` is the tenant's, for the time fact.
    `cache_ttl` is the prompt cache's lifetime the breakpoints ask for ("5m" or "1h")."""

    budget_tokens: int = 0
    compaction_model: str = ""
    live_facts: tuple[str, ...] = ()
    retriever: str = ""
    knowledge_documents: int = 0
    knowledge_chars: int = 0
    timezone: str = "UTC"
    cache_ttl: str = "5m"

    def to_json(self) -> dict[str, Any]:
        """The stored form."""
        data = asdict(self)
        data["live_facts"] = list(self.live_facts)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ContextPolicy:
        """What `to_json` stored (a field it lacks keeps its default)."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        if "live_facts" in values:
            values["live_facts"] = tuple(values["live_facts"])
        return cls(**values)


MCP_AUTH_MODES = ("none", "bearer", "oauth")


@dataclass(frozen=True, slots=True)
class McpServer:
    """An MCP server an agent uses as a tool source. `auth` is "none", "bearer" (the token is
    the secret named `bearer_secret`, read from the secret store: never the value itself) or
    "oauth" (the run principal's token, from a connection). `tools` is the allowlist of the
    server's tool names; `risk` overrides the category a tool's annotations give it."""

    name: str
    url: str
    tools: tuple[str, ...]
    transport: str = "streamable-http"
    auth: str = "none"
    bearer_secret: str = ""
    risk: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The stored form, as the agent document writes it (`auth` a mode or `{bearer}`)."""
        stored: dict[str, Any] = {
            "name": self.name,
            "url": self.url,
            "transport": self.transport,
            "auth": {"bearer": self.bearer_secret} if self.auth == "bearer" else self.auth,
            "tools": list(self.tools),
        }
        if self.risk:
            stored["risk"] = dict(sorted(self.risk.items()))
        return stored

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> McpServer:
        """What `to_json` stored, or an agent document's `mcp_servers` entry."""
        auth = data.get("auth", "none")
        bearer = ""
        if isinstance(auth, Mapping):
            bearer = str(auth["bearer"])
            auth = "bearer"
        return cls(
            name=str(data["name"]),
            url=str(data["url"]),
            tools=tuple(str(t) for t in data.get("tools", ())),
            transport=str(data.get("transport", "streamable-http")),
            auth=str(auth),
            bearer_secret=bearer,
            risk={str(k): str(v) for k, v in dict(data.get("risk", {})).items()},
        )


DEFAULT_MAX_DEPTH = 3
"""How deep a run tree may grow when an agent's `delegation` sets no `max_depth` (root 0)."""
DEFAULT_MAX_CHILDREN = 8
"""How many child runs one run may start when its `delegation` sets no `max_children`."""


@dataclass(frozen=True, slots=True)
class Delegation:
    """Whom an agent's runs may hand work to with the built-in `delegate` tool (its document's
    `delegation`): `agents` by name, a tree at most `max_depth` deep (the root is 0), at most
    `max_children` children per run."""

    agents: tuple[str, ...] = ()
    max_depth: int = DEFAULT_MAX_DEPTH
    max_children: int = DEFAULT_MAX_CHILDREN

    def to_json(self) -> dict[str, Any]:
        return {
            "agents": list(self.agents),
            "max_depth": self.max_depth,
            "max_children": self.max_children,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Delegation:
        return cls(
            tuple(str(a) for a in data.get("agents", ())),
            int(data.get("max_depth", DEFAULT_MAX_DEPTH)),
            int(data.get("max_children", DEFAULT_MAX_CHILDREN)),
        )


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """The agent an attempt runs as. `system_blocks` are the persona's instructions and then
    each selected skill's, in that order (`system_prompt` is them flat); `tool_allowlist` is the
    agent's tools with the persona's and the skills' added."""

    model: str
    agent: str = ""
    system_prompt: str = ""
    system_blocks: tuple[SystemBlock, ...] = ()
    tool_allowlist: tuple[str, ...] = ()
    limits: Limits = Limits()
    prices: Mapping[str, Price] = field(default_factory=dict)
    persona: Bundle | None = None
    skills: tuple[Bundle, ...] = ()
    context: ContextPolicy = ContextPolicy()
    # The agent document's approval policy as canonical JSON text (interactions reads it with
    # tether.agent_spec); "" for a run routed by `tenants.agent`, whose tenant policy decides.
    approvals: str = ""
    # The agent document's MCP servers, whose allowlisted tools the worker offers beside
    # `tool_allowlist`'s as `server__tool`.
    mcp_servers: tuple[McpServer, ...] = ()
    # How many of the agent's runs may run at once across the pool (its document's
    # `limits.max_running`); 0: no cap. The orchestrator's claim holds it, the worker never
    # reads it.
    max_running: int = 0
    # Whom its runs may delegate to (the `delegate` tool is offered only when set).
    delegation: Delegation | None = None

    def to_json(self) -> dict[str, Any]:
        """The stored form (`routings.config`); `approvals`, `mcp_servers` and `max_running`
        only when set,
        so a decision routed by `tenants.agent` keeps the digest (routing id) it had before."""
        stored: dict[str, Any] = {
            "agent": self.agent,
            "model": self.model,
            "system_prompt": self.system_prompt,
            "system_blocks": [asdict(b) for b in self.system_blocks],
            "tool_allowlist": list(self.tool_allowlist),
            "limits": asdict(self.limits),
            "prices": {model: asdict(price) for model, price in self.prices.items()},
            "persona": None if self.persona is None else self.persona.to_json(),
            "skills": [s.to_json() for s in self.skills],
            "context": self.context.to_json(),
        }
        if self.approvals:
            stored["approvals"] = self.approvals
        if self.mcp_servers:
            stored["mcp_servers"] = [m.to_json() for m in self.mcp_servers]
        if self.max_running:
            stored["max_running"] = self.max_running
        if self.delegation is not None:
            stored["delegation"] = self.delegation.to_json()
        return stored

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AgentConfig:
        """What `to_json` stored; a decision stored before personas and skills has none, and
        the default context policy."""
        persona = data.get("persona")
        return cls(
            model=str(data["model"]),
            agent=str(data.get("agent", "")),
            system_prompt=str(data.get("system_prompt", "")),
            system_blocks=tuple(SystemBlock(**b) for b in data.get("system_blocks", ())),
            tool_allowlist=tuple(data.get("tool_allowlist", ())),
            limits=Limits(**data.get("limits", {})),
            prices={m: Price(**p) for m, p in data.get("prices", {}).items()},
            persona=None if persona is None else Bundle.from_json(persona),
            skills=tuple(Bundle.from_json(s) for s in data.get("skills", ())),
            context=ContextPolicy.from_json(data.get("context", {})),
            approvals=str(data.get("approvals", "")),
            mcp_servers=tuple(McpServer.from_json(m) for m in data.get("mcp_servers", ())),
            max_running=int(data.get("max_running", 0)),
            delegation=(
                Delegation.from_json(data["delegation"]) if data.get("delegation") else None
            ),
        )


def secret_names(stored: Mapping[str, Any]) -> tuple[str, ...]:
    """The secrets a stored routing decision (`AgentConfig.to_json`) names: its MCP servers'
    bearer secrets, each once. A lease holder may read these and no other of the tenant's."""
    servers = (McpServer.from_json(m) for m in stored.get("mcp_servers", ()))
    return tuple(dict.fromkeys(s.bearer_secret for s in servers if s.auth == "bearer"))


def merged_tools(*lists: Sequence[str]) -> tuple[str, ...]:
    """The tools of every list, first appearance first, each once."""
    return tuple(dict.fromkeys(name for names in lists for name in names))
