"""The agent configuration a run is routed with, to and from the wire: the AgentConfig a lease
and a render job carry (its persona and skills as bundles, its context policy, MCP servers and
delegation), and what a run shows of the routing decision it is pinned to."""

from __future__ import annotations

from dataclasses import asdict, fields

from tether.convert.mcp import mcp_servers_from_proto, mcp_servers_to_proto
from tether.domain import (
    AgentConfig,
    Bundle,
    ContextPolicy,
    Delegation,
    Limits,
    RunRouting,
    SystemBlock,
)
from tether.pricing import Price
from tether.v1 import common_pb2, orchestrator_pb2


def _bundle_to_proto(bundle: Bundle) -> orchestrator_pb2.Bundle:
    return orchestrator_pb2.Bundle(
        name=bundle.name,
        version=bundle.version,
        instructions=bundle.instructions,
        tools=list(bundle.tools),
        sources=list(bundle.sources),
        channels=list(bundle.channels),
    )


def _bundle_from_proto(message: orchestrator_pb2.Bundle) -> Bundle:
    return Bundle(
        message.name,
        message.version,
        message.instructions,
        tuple(message.tools),
        tuple(message.sources),
        tuple(message.channels),
    )


def config_to_proto(config: AgentConfig) -> orchestrator_pb2.AgentConfig:
    """The AgentConfig message of a routing decision."""
    context = config.context
    return orchestrator_pb2.AgentConfig(
        agent=config.agent,
        model=config.model,
        system_prompt=config.system_prompt,
        system_blocks=[
            orchestrator_pb2.SystemBlock(text=b.text, cache_control=b.cache_control)
            for b in config.system_blocks
        ],
        tool_allowlist=list(config.tool_allowlist),
        limits=orchestrator_pb2.Limits(**asdict(config.limits)),
        prices=[
            orchestrator_pb2.ModelPrice(model=m, **asdict(p)) for m, p in config.prices.items()
        ],
        persona=None if config.persona is None else _bundle_to_proto(config.persona),
        skills=[_bundle_to_proto(s) for s in config.skills],
        context=orchestrator_pb2.ContextPolicy(
            budget_tokens=context.budget_tokens,
            compaction_model=context.compaction_model,
            live_facts=list(context.live_facts),
            retriever=context.retriever,
            knowledge_documents=context.knowledge_documents,
            knowledge_chars=context.knowledge_chars,
            timezone=context.timezone,
            cache_ttl=context.cache_ttl,
        ),
        approvals=config.approvals,
        mcp_servers=mcp_servers_to_proto(config.mcp_servers),
        delegation=(
            None
            if config.delegation is None
            else orchestrator_pb2.Delegation(
                agents=list(config.delegation.agents),
                max_depth=config.delegation.max_depth,
                max_children=config.delegation.max_children,
            )
        ),
    )


def config_from_proto(message: orchestrator_pb2.AgentConfig) -> AgentConfig:
    """The routing decision an AgentConfig message carries. One from an orchestrator of the
    previous release has no persona, skills or context policy: the attempt runs without them."""
    context = message.context
    return AgentConfig(
        model=message.model,
        system_prompt=message.system_prompt,
        system_blocks=tuple(SystemBlock(b.text, b.cache_control) for b in message.system_blocks),
        tool_allowlist=tuple(message.tool_allowlist),
        limits=Limits(**{f.name: getattr(message.limits, f.name) for f in fields(Limits)}),
        prices={
            p.model: Price(p.input, p.output, p.cache_write, p.cache_read) for p in message.prices
        },
        agent=message.agent,
        persona=_bundle_from_proto(message.persona) if message.HasField("persona") else None,
        skills=tuple(_bundle_from_proto(s) for s in message.skills),
        context=ContextPolicy(
            budget_tokens=context.budget_tokens,
            compaction_model=context.compaction_model,
            live_facts=tuple(context.live_facts),
            retriever=context.retriever,
            knowledge_documents=context.knowledge_documents,
            knowledge_chars=context.knowledge_chars,
            timezone=context.timezone or "UTC",
            cache_ttl=context.cache_ttl or "5m",
        ),
        approvals=message.approvals,
        mcp_servers=mcp_servers_from_proto(message.mcp_servers),
        delegation=(
            Delegation(
                tuple(message.delegation.agents),
                message.delegation.max_depth,
                message.delegation.max_children,
            )
            if message.HasField("delegation")
            else None
        ),
    )


def routing_to_proto(routing: RunRouting) -> common_pb2.RunRouting:
    """What a run shows of the routing decision it is pinned to."""
    config = AgentConfig.from_json(routing.stored)
    return common_pb2.RunRouting(
        routing_id=routing.routing_id,
        agent=config.agent,
        model=config.model,
        persona=None
        if config.persona is None
        else common_pb2.BundleRef(name=config.persona.name, version=config.persona.version),
        skills=[common_pb2.BundleRef(name=s.name, version=s.version) for s in config.skills],
        tool_allowlist=list(config.tool_allowlist),
        agent_version=routing.agent_version,
    )
