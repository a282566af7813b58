"""A tool package installed beside the worker, as a team installs its own (examples/tools, which
`make venv` installs with `pip install -e`): the worker loads it through its `tether.tools` entry
point, announces its tools in the Work hello so `tether tools list` shows them, and an agent
document naming them gets them: the model calls the read tool and the run completes with its
result; the external write runs under a standing grant through the effects record."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from tether_example_tools import TicketDesk, lookup_order

from tests.system.execution_support import ExecStack, Tenant, exec_stack, parts_of, wait_for_status
from tests.system.streaming_support import prompt
from tests.system.test_agents import AGENT_SCOPES, catalog, cli_json, stack_file
from tether.domain import schema_sha256
from tether.testing.eventually import eventually
from tether.testing.model_server import TextTurn, ToolUseTurn

# a whole stack of processes per module: tens of seconds, so in `make slow` (the 15-minute budget)
pytestmark = pytest.mark.slow


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ExecStack]:
    run_dir = Path(tmp_path_factory.mktemp("tool-package"))
    async with exec_stack(pg_server_url, template_db, redis_url, run_dir, workers=1) as running:

        async def announced() -> bool:
            return "lookup_order" in {row.name for row in await catalog(running)}

        await eventually(announced, what="the example package's tools in the catalog")
        yield running


async def apply(tenant: Tenant, document: dict[str, Any]) -> None:
    base = f"http://{tenant.stack.services.http_addresses()['gateway']}"
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{base}/v2/agents",
            json={"spec": json.dumps(document)},
            headers={"Authorization": f"Bearer {tenant.api_key}"},
        ) as response,
    ):
        assert response.status in (200, 201), await response.text()


async def tool_results(stack: ExecStack, run_id: str) -> list[dict[str, Any]]:
    return [
        dict(p.payload) for p in await parts_of(stack.db_url, run_id) if p.kind == "tool_result"
    ]


async def test_the_packages_tools_are_listed_with_their_schemas_and_risks(
    stack: ExecStack, tmp_path: Path
) -> None:
    tenant = await stack.tenant(scopes=AGENT_SCOPES)
    listed = {
        t["name"]: t
        for t in await cli_json(
            "tools", "list", "--stack", stack_file(stack, tenant.api_key, tmp_path)
        )
    }
    create = TicketDesk().create_ticket
    assert {
        k: listed["lookup_order"][k] for k in ("risk", "writes_externally", "schema_sha256")
    } == {
        "risk": "read",
        "writes_externally": False,
        "schema_sha256": schema_sha256(lookup_order.spec.input_schema),
    }
    assert {
        k: listed["create_ticket"][k] for k in ("risk", "writes_externally", "schema_sha256")
    } == {
        "risk": "publish",
        "writes_externally": True,
        "schema_sha256": schema_sha256(create.spec.input_schema),
    }


async def test_an_agent_naming_the_read_tool_gets_it_and_the_run_completes_with_its_result(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant(scopes=AGENT_SCOPES)
    await apply(
        tenant, {"name": "orders", "instructions": "Look orders up.", "tools": ["lookup_order"]}
    )
    text = prompt("where is my order")
    stack.model.script(
        text,
        [ToolUseTurn("lookup_order", {"order_id": "ORD-1002"}), TextTurn("It is being packed.")],
    )
    run_id = await tenant.send(text)
    run = await wait_for_status(stack.db_url, run_id, "completed")
    (result,) = await tool_results(stack, run_id)
    assert not result.get("isError", False)
    assert json.loads(result["content"]) == {
        "order_id": "ORD-1002",
        "status": "packing",
        "items": "1 x office chair",
    }
    first, second = [r.body for r in stack.model.requests if r.script_key == text]
    assert [t["name"] for t in first["tools"]] == ["lookup_order"]
    assert first["tools"][0]["input_schema"] == lookup_order.spec.input_schema
    assert "office chair" in json.dumps(second["messages"][-1])
    assert run.result_text == "It is being packed."


async def test_the_packages_write_runs_once_under_a_grant_and_a_bad_input_is_refused(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant(scopes=AGENT_SCOPES, grant=["create_ticket"])
    await apply(
        tenant, {"name": "desk", "instructions": "Open tickets.", "tools": ["create_ticket"]}
    )
    text = prompt("open a ticket")
    stack.model.script(
        text,
        [
            ToolUseTurn("create_ticket", {"title": "x"}),
            ToolUseTurn("create_ticket", {"title": "lamp broken", "order_id": "ORD-1001"}),
            TextTurn("Opened."),
        ],
    )
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "completed")
    refused, opened = await tool_results(stack, run_id)
    assert refused.get("isError") is True
    assert "input.title: must be at least 3 characters long" in refused["content"]
    assert not opened.get("isError", False)
    assert (
        opened["content"].startswith("opened ticket TCK-") and "about ORD-1001" in opened["content"]
    )
