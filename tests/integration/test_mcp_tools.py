"""The worker's MCP tools (services.worker.mcp.tools) through the one tool path, against the local
MCP stand-in over loopback HTTP: the lease's offer and its warnings, a warm lease costing no round
trip, a call carrying its idempotency key, an unknown outcome leaving the effects record open so
the retry re-sends the same key (the server executes once), a server that is down failing the
call without recording it, and a large result truncated as any tool's."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from services.worker.mcp import McpClients
from services.worker.mcp.tools import OUTCOME_UNKNOWN, LeasedTools, McpToolbox
from tether.domain import AgentConfig, EffectState
from tether.domain import McpServer as Entry
from tether.errors import NotFound
from tether.testing.mcp_server import McpServer
from tether.testing.tools import MemoryEffects, ToolKit


def agent(*servers: Entry) -> AgentConfig:
    return AgentConfig(model="m", agent="shop", mcp_servers=servers)


def shop(server: McpServer, **more: object) -> Entry:
    fields: dict[str, object] = {
        "tools": ("lookup_order", "slow_report"),
        "risk": {"slow_report": "read"},
        **more,
    }
    return Entry("shop", server.url, **fields)  # type: ignore[arg-type]


@pytest.fixture
async def box() -> AsyncIterator[McpToolbox]:
    made = McpToolbox(McpClients(connect_timeout_s=5), call_timeout_s=0.5)
    yield made
    await made.clients.aclose()


def kit(leased: LeasedTools, name: str, **more: object) -> ToolKit:
    return ToolKit(leased.tools[name].tool, **more)  # type: ignore[arg-type]


async def test_the_lease_offers_sorted_tools_says_what_it_left_out_and_a_warm_one_costs_nothing(
    box: McpToolbox,
) -> None:
    async with McpServer() as server:
        config = agent(shop(server, tools=("slow_report", "lookup_order", "gone", "cancel_order")))
        first = await box.lease(config, None, taken={"shop__cancel_order"})
        again = await box.lease(config, None, taken={"shop__cancel_order"})
        listings = server.ledger.listings
    assert [s["name"] for s in first.specs] == ["shop__lookup_order", "shop__slow_report"]
    assert first.warnings == ("mcp_tool_omitted:shop__gone", "mcp_tool_omitted:shop__cancel_order")
    assert not first.tools["shop__lookup_order"].spec.writes_externally, "a read: no record"
    assert str(first.tools["shop__slow_report"].spec.risk) == "read"
    assert listings == 1, "the second lease was served from the cache"
    assert again.specs == first.specs
    assert again.tools["shop__lookup_order"] is first.tools["shop__lookup_order"], "prepared once"


async def test_a_bearer_server_whose_secret_is_missing_is_left_out_with_a_warning(
    box: McpToolbox,
) -> None:
    async def no_secret(name: str) -> str:
        raise NotFound(f"no secret named {name!r}")

    async with McpServer(auth={"bearer": "s3cret"}) as server:
        missing = await box.lease(
            agent(shop(server, auth="bearer", bearer_secret="tok")), no_secret, ()
        )

        async def the_secret(name: str) -> str:
            return "s3cret"

        present = await box.lease(
            agent(shop(server, auth="bearer", bearer_secret="tok")), the_secret, ()
        )
        looked = await kit(present, "shop__lookup_order").call({"order_id": "A-1001"})
    assert missing.tools == {} and missing.warnings == ("mcp_server_omitted:shop",)
    assert not looked.is_error and '"shipped"' in looked.content


async def test_a_read_carries_its_key_unrecorded_and_a_bad_input_never_leaves(
    box: McpToolbox,
) -> None:
    effects = MemoryEffects()
    async with McpServer() as server:
        leased = await box.lease(agent(shop(server)), None, ())
        lookup = kit(leased, "shop__lookup_order", effects=effects)
        refused = await lookup.call({"order_id": 7})
        looked = await lookup.call({"order_id": "A-1002"})
        again = await lookup.call({"order_id": "A-1002"})
        executions = dict(server.ledger.executions_by_key)
        replays = dict(server.ledger.replays)
    assert refused.error_code == "tool_invalid_input" and refused.fired == 0
    assert not looked.is_error and '"processing"' in looked.content
    assert again.fired == 1 and not again.replayed, "a read is not recorded: it runs again"
    assert looked.idempotency_key is None and effects.state("") is None
    # ... and re-sends the key the record would have used: the server answers it once.
    assert list(executions.values()) == [1] and list(replays.values()) == [1]


async def test_an_unknown_outcome_leaves_the_record_open_and_the_retry_runs_once(
    box: McpToolbox,
) -> None:
    effects = MemoryEffects()
    async with McpServer() as server:
        # An effect (its risk not read), run under a standing grant.
        config = agent(shop(server, risk={"slow_report": "publish"}))
        leased = await box.lease(config, None, ())
        slow = kit(leased, "shop__slow_report", effects=effects, approval="grant")
        timed_out = await slow.call({"topic": "q1"})
        assert timed_out.idempotency_key is not None
        state = effects.state(timed_out.idempotency_key)
        server.release_slow()
        retried = await slow.call({"topic": "q1"})
        executions = dict(server.ledger.executions)
    assert timed_out.error_code == OUTCOME_UNKNOWN, timed_out
    assert "Whether shop__slow_report ran is unknown" in timed_out.content
    assert state is EffectState.IN_PROGRESS, "not recorded: the retry fires again"
    assert retried.idempotency_key == timed_out.idempotency_key
    assert not retried.is_error and retried.content == "report on q1"
    assert executions == {"slow_report": 1}, "the same key: the server ran it once"


async def test_a_server_down_fails_the_call_unrecorded_and_a_later_call_succeeds(
    box: McpToolbox,
) -> None:
    effects = MemoryEffects()
    server = McpServer()
    await server.start()
    try:
        leased = await box.lease(agent(shop(server)), None, ())
        lookup = kit(leased, "shop__lookup_order", effects=effects)
        await server.stop()
        down = await lookup.call({"order_id": "A-1001"})
        await server.start()
        up = await lookup.call({"order_id": "A-1001"})
    finally:
        await server.stop()
    assert down.is_error and down.error_code == "mcp_server_down", down
    assert "did not run" in down.content
    assert not up.is_error and '"shipped"' in up.content and not up.replayed


async def test_a_result_over_the_inline_limit_is_truncated_as_any_tools(box: McpToolbox) -> None:
    async with McpServer() as server:
        leased = await box.lease(agent(shop(server)), None, ())
        looked = await kit(leased, "shop__lookup_order", max_inline_bytes=10).call(
            {"order_id": "A-1001"}
        )
    assert looked.truncated and "[truncated:" in looked.content
