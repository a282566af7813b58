"""A tenant's agents against the real PostgreSQL: versions and publishing (apply, identical
apply, conditional apply, rollback, removal), each change audited, and the claim routing runs
among the published versions by channel, pinned to the version that took them."""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from services.admission.domain import FreshnessPolicy
from services.admission.service import Admitter
from services.orchestrator.agents import Agents
from services.orchestrator.execution import Execution
from services.orchestrator.retention import Retention
from tests.integration.test_admission import _tenant, chat, messaging
from tether.db.schema import agent_sets, agent_versions, audit_log, routings
from tether.db.schema import agents as agents_table
from tether.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound
from tether.settings import RetainingSettings
from tether.targets import TargetPolicy

pytestmark = pytest.mark.asyncio(loop_scope="session")

ACTOR = {"key_id": "key-1", "principal_id": "alice"}


def _doc(name: str, instructions: str, **more: Any) -> str:
    return json.dumps({"name": name, "instructions": instructions, **more})


def _execution(engine: AsyncEngine) -> Execution:
    return Execution.build(engine, None, lease_ttl_s=30, claim_poll_s=60)


async def test_versions_are_numbered_published_and_audited(engine: AsyncEngine) -> None:
    await _tenant(engine, "t1")
    agents = Agents(engine)
    first = await agents.apply("t1", _doc("helper", "Be brief."), ACTOR)
    assert (first.version, first.created) == (1, True)
    same = await agents.apply("t1", _doc("helper", "Be brief."), ACTOR)
    assert (same.version, same.created) == (1, False), "an identical apply creates nothing"
    second = await agents.apply("t1", _doc("helper", "Be kind."), ACTOR, base_version=1)
    assert (second.version, second.created) == (2, True)

    with pytest.raises(Aborted, match="at version 2, not 1"):
        await agents.apply("t1", _doc("helper", "Stale."), ACTOR, base_version=1)
    assert [v.version for v in await agents.versions("t1", "helper")] == [1, 2]

    rolled = await agents.rollback("t1", "helper", 1, ACTOR)
    assert rolled.version == 1
    shown = await agents.show("t1", "helper")
    assert (shown.version.version, shown.published_version, shown.default) == (1, 1, True)
    assert json.loads(shown.version.written)["instructions"] == "Be brief."

    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                select(audit_log.c.action, audit_log.c.detail)
                .where(audit_log.c.tenant_id == "t1")
                .order_by(audit_log.c.id)
            )
        ).all()
    assert [(r.action, r.detail["from_version"], r.detail["to_version"]) for r in rows] == [
        ("agent.applied", 0, 1),
        ("agent.applied", 1, 2),
        ("agent.rolled_back", 2, 1),
    ]
    assert rows[0].detail["actor"] == ACTOR


async def test_a_rollback_from_a_stale_base_is_aborted_and_writes_nothing(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "t1")
    agents = Agents(engine)
    await agents.apply("t1", _doc("helper", "Be brief."), ACTOR)
    await agents.apply("t1", _doc("helper", "Be kind."), ACTOR)
    await agents.apply("t1", _doc("helper", "Be quick."), ACTOR)

    async def written() -> tuple[list[Any], list[Any]]:
        async with engine.connect() as conn:
            audited = (
                await conn.execute(select(audit_log.c.id).where(audit_log.c.tenant_id == "t1"))
            ).all()
            revision = (
                await conn.execute(select(agent_sets).where(agent_sets.c.tenant_id == "t1"))
            ).all()
        return list(audited), list(revision)

    before = await written()
    with pytest.raises(Aborted, match="at version 3, not 2") as refused:
        await agents.rollback("t1", "helper", 1, ACTOR, base_version=2)
    assert refused.value.details == {"agent": "helper", "published_version": 3}
    assert (await agents.show("t1", "helper")).published_version == 3
    assert await written() == before, "a refused rollback audits and bumps nothing"

    rolled = await agents.rollback("t1", "helper", 1, ACTOR, base_version=3)
    assert (rolled.version, rolled.created) == (1, True)
    assert (await agents.show("t1", "helper")).published_version == 1


async def test_another_tenants_agent_is_not_found_like_an_absent_one(engine: AsyncEngine) -> None:
    await _tenant(engine, "t1")
    await _tenant(engine, "t2")
    agents = Agents(engine)
    await agents.apply("t1", _doc("secret", "Mine."), ACTOR)
    for name in ("secret", "absent"):
        with pytest.raises(NotFound, match=f"agent '{name}' not found"):
            await agents.show("t2", name)
        with pytest.raises(NotFound, match=f"agent '{name}' not found"):
            await agents.rollback("t2", name, 1, ACTOR)
        with pytest.raises(NotFound, match=f"agent '{name}' not found"):
            await agents.remove("t2", name, ACTOR)
    assert await agents.listed("t2") == []


async def test_equal_routes_are_refused_naming_both(engine: AsyncEngine) -> None:
    await _tenant(engine, "t1")
    agents = Agents(engine)
    routes = [{"channel": "whatsapp"}]
    await agents.apply("t1", _doc("support", "Help.", routes=routes), ACTOR)
    with pytest.raises(InvalidArgument, match="'support' and 'sales'"):
        await agents.apply("t1", _doc("sales", "Sell.", routes=routes), ACTOR)
    assert [a.agent.name for a in await agents.listed("t1")] == ["support"]


async def test_runs_are_routed_by_channel_and_pinned_to_their_version(engine: AsyncEngine) -> None:
    await _tenant(engine, "t1")
    agents = Agents(engine)
    await agents.apply("t1", _doc("general", "You are general."), ACTOR)
    await agents.apply(
        "t1", _doc("support", "You support.", routes=[{"channel": "whatsapp"}]), ACTOR
    )
    execution = _execution(engine)
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    web = (await admitter.admit(chat("r-1", conversation="c-1"))).run.run_id
    guest = (await admitter.admit(messaging("r-2", "thread-1", tenant="t1"))).run.run_id
    first = {c.run.run_id: c for c in await execution.claims.claim_many("w", 2)}
    assert (first[web].config.agent, first[web].config.system_prompt) == (
        "general",
        "You are general.",
    )
    assert (first[guest].config.agent, first[guest].config.system_prompt) == (
        "support",
        "You support.",
    )

    # A new version while the run waits: the run keeps its version, the next run gets the new.
    assert await execution.attempts.release(guest, first[guest].run.lease_epoch)
    with pytest.raises(FailedPrecondition, match="pinned by unfinished runs"):
        await agents.remove("t1", "support", ACTOR)
    await agents.apply(
        "t1", _doc("support", "You support, v2.", routes=[{"channel": "whatsapp"}]), ACTOR
    )
    later = (await admitter.admit(messaging("r-3", "thread-2", tenant="t1"))).run.run_id
    again = {c.run.run_id: c for c in await execution.claims.claim_many("w", 3)}
    assert again[guest].config.system_prompt == "You support."
    assert again[later].config.system_prompt == "You support, v2."

    # A rollback routes the next run to the old version.
    await agents.rollback("t1", "support", 1, ACTOR)
    last = (await admitter.admit(messaging("r-4", "thread-3", tenant="t1"))).run.run_id
    [rolled] = [c for c in await execution.claims.claim_many("w", 3) if c.run.run_id == last]
    assert rolled.config.system_prompt == "You support."

    with pytest.raises(FailedPrecondition, match="the tenant's default"):
        await agents.remove("t1", "general", ACTOR)


async def test_the_routing_names_the_agent_and_its_version(engine: AsyncEngine) -> None:
    await _tenant(engine, "t1")
    agents = Agents(engine)
    await agents.apply("t1", _doc("general", "One."), ACTOR)
    await agents.apply("t1", _doc("general", "Two."), ACTOR)
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    await admitter.admit(chat("v-1", conversation="v-1"))
    [claimed] = await _execution(engine).claims.claim_many("w", 1)
    async with engine.connect() as conn:
        stored = (
            await conn.execute(
                select(routings.c.config).where(routings.c.routing_id == claimed.run.routing_id)
            )
        ).scalar_one()
    assert (stored["agent"], stored["agent_version"]) == ("general", 2)


async def test_a_deleted_tenants_agents_go_with_its_runs_and_no_one_elses(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "t1")
    await _tenant(engine, "t2")
    agents = Agents(engine)
    await agents.apply("t1", _doc("general", "One."), ACTOR)
    await agents.apply("t1", _doc("general", "Two."), ACTOR)
    await agents.apply("t1", _doc("support", "Help.", routes=[{"channel": "whatsapp"}]), ACTOR)
    await agents.apply("t2", _doc("general", "Theirs."), ACTOR)
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    for i in range(2):
        await admitter.admit(chat(f"d-{i}", conversation=f"d-{i}"))
    retention = Retention(engine, RetainingSettings(retention_batch=2))
    left = True
    while left:
        _, left = await retention.delete_tenant("t1")
    async with engine.connect() as conn:
        for table in (agents_table, agent_versions, agent_sets):
            found = await conn.execute(
                select(table.c.tenant_id).where(table.c.tenant_id.in_(["t1", "t2"]))
            )
            assert {row.tenant_id for row in found} == {"t2"}, table.name
    assert [a.agent.name for a in await agents.listed("t2")] == ["general"]


async def test_an_mcp_server_url_the_target_policy_forbids_is_refused_at_its_pointer(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "t1")
    server = {"name": "orders", "tools": ["lookup_order"]}
    doc = _doc(
        "helper",
        "Be brief.",
        mcp_servers=[
            {**server, "url": "https://93.184.215.14/mcp"},
            {**server, "name": "local", "url": "http://127.0.0.1:8931/mcp"},
            {**server, "name": "intranet", "url": "http://10.1.2.3/mcp"},
            {**server, "name": "secret", "url": "https://user:pw@93.184.215.14/mcp"},
        ],
    )
    with pytest.raises(InvalidArgument) as refused:
        await Agents(engine).apply("t1", doc, ACTOR)
    pointers = [v["pointer"] for v in refused.value.details["violations"]]  # type: ignore[index]
    assert pointers == ["/mcp_servers/1/url", "/mcp_servers/2/url", "/mcp_servers/3/url"]
    assert "loopback address, refused unless the operator allows it" in refused.value.message
    assert "pw" not in refused.value.message
    with pytest.raises(NotFound):  # nothing was written
        await Agents(engine).versions("t1", "helper")

    local_only = _doc("helper", "Be brief.", mcp_servers=[json.loads(doc)["mcp_servers"][1]])
    applied = await Agents(engine, target_policy=TargetPolicy.parse("loopback")).apply(
        "t1", local_only, ACTOR
    )
    assert (applied.version, applied.created) == (1, True)


async def test_a_delegation_to_an_agent_the_tenant_lacks_is_refused_and_nothing_written(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "t1")
    await _tenant(engine, "t2")
    agents = Agents(engine)
    await agents.apply("t2", _doc("researcher", "Find things."), ACTOR)  # another tenant's
    lead = _doc("lead", "Plan.", delegation={"agents": ["lead", "researcher", "writer"]})
    with pytest.raises(InvalidArgument) as refused:
        await agents.apply("t1", lead, ACTOR)
    pointers = [v["pointer"] for v in refused.value.details["violations"]]  # type: ignore[index]
    assert pointers == ["/delegation/agents/1", "/delegation/agents/2"]
    assert "names agent 'researcher', which this tenant does not have" in refused.value.message
    with pytest.raises(NotFound):
        await agents.versions("t1", "lead")

    await agents.apply("t1", _doc("researcher", "Find things."), ACTOR)
    await agents.apply("t1", _doc("writer", "Write."), ACTOR)
    applied = await agents.apply("t1", lead, ACTOR)
    assert (applied.version, applied.created) == (1, True)
