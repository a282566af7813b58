"""The tool catalog against the real PostgreSQL: workers' announcements kept per tool name (the
last announcement wins, any replica's worker counts), and the check an apply passes: every tool
the document names (its own, its persona's, personas' and skills') is in the catalog, every
model it runs has a price; a refusal names each at its pointer and writes nothing."""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from services.orchestrator.agents import Agents
from services.orchestrator.catalog import ToolCatalog
from tests.integration.test_admission import _tenant
from tether.db.schema import agent_versions
from tether.domain import ToolAnnouncement, schema_sha256
from tether.errors import FailedPrecondition, InvalidArgument

pytestmark = pytest.mark.asyncio(loop_scope="session")

ACTOR = {"key_id": "key-1", "principal_id": "alice"}
GET_TIME = ToolAnnouncement("get_time", schema_sha256({"type": "object"}), "read", False)
PUBLISH = ToolAnnouncement(
    "publish_post", schema_sha256({"type": "object", "a": 1}), "publish", True
)
PRICE = {"input": 1, "output": 2, "cache_write": 1.25, "cache_read": 0.1}


def _doc(**more: Any) -> str:
    return json.dumps({"name": "helper", "instructions": "Be brief.", **more})


async def _versions(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(select(func.count()).select_from(agent_versions))).one()[0])


async def test_the_last_announcement_of_a_tool_wins_and_the_others_stay(
    engine: AsyncEngine,
) -> None:
    catalog = ToolCatalog(engine)
    await catalog.announce("worker-a", [GET_TIME, PUBLISH])
    changed = ToolAnnouncement("get_time", schema_sha256({"type": "object", "b": 2}), "read", False)
    await catalog.announce("worker-b", [changed])

    found = {t.tool.name: t for t in await catalog.listed()}
    assert sorted(found) == ["get_time", "publish_post"]
    assert (found["get_time"].tool, found["get_time"].announced_by) == (changed, "worker-b")
    assert (found["publish_post"].tool, found["publish_post"].announced_by) == (PUBLISH, "worker-a")
    assert found["get_time"].announced_at >= found["publish_post"].announced_at


async def test_an_apply_naming_tools_not_in_the_catalog_is_refused_naming_each(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "t1")
    await ToolCatalog(engine).announce("worker-a", [GET_TIME])
    agents = Agents(engine)
    doc = _doc(
        tools=["get_time", "send_fax"],
        skills=[{"name": "s", "version": 1, "instructions": "Skill.", "tools": ["shred"]}],
    )

    with pytest.raises(InvalidArgument) as refused:
        await agents.apply("t1", doc, ACTOR)

    violations = refused.value.details["violations"]
    assert [(v["pointer"], v["message"]) for v in violations] == [
        ("/skills/0/tools/0", "tool 'shred' is not in the tool catalog; "
         "see `tether tools list` for the tools the workers announce"),
        ("/tools/1", "tool 'send_fax' is not in the tool catalog; "
         "see `tether tools list` for the tools the workers announce"),
    ]  # fmt: skip
    assert "send_fax" in refused.value.message and "tether tools list" in refused.value.message
    assert await _versions(engine) == 0

    accepted = await agents.apply("t1", _doc(tools=["get_time"]), ACTOR)
    assert (accepted.version, accepted.created) == (1, True)


async def test_a_model_without_a_price_is_refused_unless_the_document_prices_it(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "t1")
    agents = Agents(engine)

    with pytest.raises(InvalidArgument) as refused:
        await agents.apply(
            "t1", _doc(model="mystery-1", context={"compaction_model": "mystery-2"}), ACTOR
        )
    pointers = [v["pointer"] for v in refused.value.details["violations"]]
    assert pointers == ["/context/compaction_model", "/model"]
    assert "model 'mystery-1' has no price: add it under /prices" in refused.value.message
    assert await _versions(engine) == 0

    priced = _doc(model="mystery-1", prices={"mystery-1": PRICE})
    assert (await agents.apply("t1", priced, ACTOR)).created
    assert (await agents.apply("t1", _doc(model="claude-haiku-5-5"), ACTOR)).version == 2


async def test_an_empty_catalog_refuses_a_document_naming_tools_and_takes_one_naming_none(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "t1")
    agents = Agents(engine)

    with pytest.raises(FailedPrecondition, match="no worker has announced its tools yet") as exc:
        await agents.apply("t1", _doc(tools=["get_time"]), ACTOR)
    assert exc.value.code == "tool_catalog_empty"
    assert await _versions(engine) == 0

    assert (await agents.apply("t1", _doc(), ACTOR)).created
