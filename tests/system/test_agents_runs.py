"""Runs of applied agents, with the services as processes: the document's approval policy is
what an approval offers (its decisions, the scopes allow-always may grant, its expiry); a run
parked for approval keeps its version across an apply; every limit of the document ends a run
with its reason. Documents are applied over HTTP v2; test_agents.py covers the surfaces."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import pytest_asyncio

from tests.system.execution_support import (
    ExecStack,
    Tenant,
    events_of,
    exec_stack,
    parts_of,
    wait_for_status,
)
from tests.system.streaming_support import prompt
from tether import apikeys
from tether.client import TetherClient
from tether.testing.model_server import ErrorTurn, TextTurn, ToolUseTurn, Usage

AGENT_SCOPES = (*apikeys.CLIENT_SCOPES, apikeys.AGENTS_READ, apikeys.AGENTS_WRITE)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ExecStack]:
    run_dir = Path(tmp_path_factory.mktemp("agent-runs"))
    async with exec_stack(pg_server_url, template_db, redis_url, run_dir, workers=1) as running:
        yield running


async def apply(tenant: Tenant, document: dict[str, Any]) -> dict[str, Any]:
    """Apply `document` as the tenant (over HTTP v2): the answer's body."""
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
        answer: dict[str, Any] = await response.json()
        return answer


def client(tenant: Tenant) -> TetherClient:
    return TetherClient(tenant.stack.addr("gateway"), tenant.api_key)


def system_of(stack: ExecStack, text: str) -> list[str]:
    """The system prompt (as JSON text) of each model request the run of `text` made."""
    return [
        json.dumps(r.body.get("system", "")) for r in stack.model.requests if r.script_key == text
    ]


async def test_the_agents_approvals_are_what_its_approval_offers_and_when_it_expires(
    stack: ExecStack,
) -> None:
    # The tenant's own policy would permit allow-always for any scope: the document narrows it.
    tenant = await stack.tenant(
        scopes=AGENT_SCOPES, policy={"always_allow_scopes": ["principal", "tenant", "category"]}
    )
    await apply(
        tenant,
        {
            "name": "careful",
            "tools": ["publish_post"],
            "approvals": {
                "ttl_seconds": 600,
                "tools": {
                    "publish_post": {"decisions": ["allow-once", "deny"], "ttl_seconds": 3600}
                },
            },
        },
    )
    text = prompt("publish carefully")
    stack.model.script(text, [ToolUseTurn("publish_post", {"text": "careful"}), TextTurn("done")])
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "waiting-for-approval")
    async with client(tenant) as tc:
        approval = (await tc.pending_approval(run_id)).approval
        assert list(approval.allowed_decisions) == ["allow-once", "deny"]
        waits = approval.expires_at.ToDatetime().timestamp() - time.time()
        assert 3600 - 60 < waits <= 3600, (
            "the tool's ttl_seconds, not the policy's or the service's"
        )
        for decision, scope in (("allow-always", "principal"), ("allow-conversation", "")):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await tc.decide(run_id, decision, scope)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, decision
            assert "allow-once" in (refused.value.details() or "")
        still = (await tc.pending_approval(run_id)).approval
        assert still.interaction_id == approval.interaction_id, "a refusal changes nothing"
        decided = await tc.decide(run_id, "allow-once")
    assert not decided.grant_id
    await wait_for_status(stack.db_url, run_id, "completed")
    assert [r.body["text"] for r in stack.ledger.records if r.body["text"] == "careful"] == [
        "careful"
    ]


async def test_a_run_parked_for_approval_keeps_its_version_after_an_apply_and_the_decision(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant(scopes=AGENT_SCOPES)
    first = {"name": "pinned", "instructions": "You are Pinned One.", "tools": ["publish_post"]}
    assert (await apply(tenant, first))["version"] == 1
    text = prompt("publish while applying")
    stack.model.script(text, [ToolUseTurn("publish_post", {"text": "pinned"}), TextTurn("done")])
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "waiting-for-approval")
    # Version 2 offers only deny: the parked approval keeps what version 1 offered.
    second = {
        **first,
        "instructions": "You are Pinned Two.",
        "approvals": {"tools": {"publish_post": {"decisions": ["deny"]}}},
    }
    assert (await apply(tenant, second))["version"] == 2
    async with client(tenant) as tc:
        approval = (await tc.pending_approval(run_id)).approval
        assert "allow-once" in approval.allowed_decisions
        await tc.decide(run_id, "allow-once")
        await wait_for_status(stack.db_url, run_id, "completed")
        run = (await tc.get_run(run_id)).run
    assert (run.routing.agent, run.routing.agent_version) == ("pinned", 1)
    systems = system_of(stack, text)
    assert len(systems) == 2, "one request before the park, one after the decision"
    assert all("Pinned One" in s and "Pinned Two" not in s for s in systems)
    later = prompt("after the apply")
    stack.model.script(later, [TextTurn("ok")])
    later_id = await tenant.send(later)
    await wait_for_status(stack.db_url, later_id, "completed")
    assert all("Pinned Two" in s for s in system_of(stack, later))


BUDGETS = [
    ({"max_steps": 2}, [ToolUseTurn("get_time")] * 3, "max_steps_exceeded"),
    ({"max_tool_calls": 1}, [ToolUseTurn("get_time")] * 3, "max_tool_calls_exceeded"),
    (
        {"max_output_tokens": 100},
        [TextTurn("long", usage=Usage(input_tokens=10, output_tokens=500))],
        "output_tokens_exceeded",
    ),
    (
        {"max_input_tokens": 100},
        [TextTurn("long", usage=Usage(input_tokens=5000, output_tokens=5))],
        "input_tokens_exceeded",
    ),
    (
        {"max_cost_usd": 0.000001},
        [TextTurn("pricey", usage=Usage(input_tokens=1000, output_tokens=1000))],
        "cost_exceeded",
    ),
]


@pytest.mark.parametrize(("limits", "turns", "warning"), BUDGETS)
async def test_each_budget_of_the_document_completes_the_run_with_its_reason(
    stack: ExecStack, limits: dict[str, Any], turns: list[object], warning: str
) -> None:
    tenant = await stack.tenant(scopes=AGENT_SCOPES)
    await apply(tenant, {"name": "budgeted", "tools": ["get_time"], "limits": limits})
    text = prompt(f"document limit {warning}")
    stack.model.script(text, turns)  # type: ignore[arg-type]
    run_id = await tenant.send(text)
    run = await wait_for_status(stack.db_url, run_id, "completed")
    assert run.warnings == [warning, "budget_exhausted"]


async def test_the_documents_wall_clock_fails_the_run_with_its_reason(stack: ExecStack) -> None:
    tenant = await stack.tenant(scopes=AGENT_SCOPES)
    await apply(
        tenant, {"name": "hasty", "tools": ["slow_task"], "limits": {"wall_clock_seconds": 1}}
    )
    text = prompt("document too slow")
    stack.model.script(text, [ToolUseTurn("slow_task", {"seconds": 30})])
    run = await wait_for_status(stack.db_url, await tenant.send(text), "failed", timeout=10)
    assert run.error["code"] == "wall_clock_exceeded"


async def test_the_documents_attempts_and_backoff_end_a_failing_run(stack: ExecStack) -> None:
    tenant = await stack.tenant(scopes=AGENT_SCOPES)
    limits = {"max_attempts": 2, "backoff_initial_seconds": 0.05, "backoff_max_seconds": 0.1}
    await apply(tenant, {"name": "brittle", "limits": limits})
    text = prompt("document overloaded")
    stack.model.script(text, [ErrorTurn(529), ErrorTurn(529), ErrorTurn(529)])
    run_id = await tenant.send(text)
    run = await wait_for_status(stack.db_url, run_id, "failed")
    assert run.error["code"] == "provider_overloaded"
    pending = [p for _, t, p in await events_of(stack.db_url, run_id) if t == "run.retry-pending"]
    assert [p["attempt"] for p in pending] == [1], "two attempts, not the default's"


async def test_the_documents_turn_and_inline_output_limits_shape_the_run(stack: ExecStack) -> None:
    tenant = await stack.tenant(scopes=AGENT_SCOPES)
    limits = {"max_tokens_per_turn": 321, "max_inline_tool_output_bytes": 1000}
    await apply(tenant, {"name": "terse", "tools": ["big_output"], "limits": limits})
    text = prompt("document big output")
    stack.model.script(text, [ToolUseTurn("big_output", {"bytes": 5000}), TextTurn("ok")])
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "completed")
    requests = [r.body for r in stack.model.requests if r.script_key == text]
    assert {body["max_tokens"] for body in requests} == {321}
    (result,) = [p for p in await parts_of(stack.db_url, run_id) if p.kind == "tool_result"]
    assert result.payload["truncated"] is True
