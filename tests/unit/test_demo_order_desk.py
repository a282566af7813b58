"""The demo model's order-desk intent (`make run`'s shop agent) and the demo MCP URL put into
an agent document."""

from __future__ import annotations

from pathlib import Path

from tether import agent_spec
from tether.stack import demo_mcp
from tether.testing.demo_agent import demo_turn
from tether.testing.model_script import ToolUseTurn

SHOP = Path(__file__).resolve().parents[2] / "examples" / "agents" / "shop.yaml"
TOOLS = [{"name": "shop__cancel_order"}, {"name": "shop__lookup_order"}, {"name": "get_time"}]


def asked(text: str, tools: list[dict[str, str]]) -> object:
    return demo_turn({"messages": [{"role": "user", "content": text}], "tools": tools})


def test_an_order_is_looked_up_or_cancelled_with_whatever_server_offers_the_tool() -> None:
    looked = asked("where is order a-1001?", TOOLS)
    cancelled = asked("please cancel order A-1002", TOOLS)
    assert isinstance(looked, ToolUseTurn) and isinstance(cancelled, ToolUseTurn)
    assert (looked.name, dict(looked.input)) == ("shop__lookup_order", {"order_id": "A-1001"})
    assert (cancelled.name, dict(cancelled.input)) == ("shop__cancel_order", {"order_id": "A-1002"})
    assert not isinstance(asked("where is order A-1001?", [{"name": "get_time"}]), ToolUseTurn)


def test_the_shop_document_names_the_demo_server_once_resolved() -> None:
    text = demo_mcp.resolve(SHOP.read_text(), "http://127.0.0.1:8931/mcp")
    shop = agent_spec.parse(text)
    (server,) = shop.normalised["mcp_servers"]
    assert server["url"] == "http://127.0.0.1:8931/mcp"
    assert server["tools"] == ["lookup_order", "cancel_order"]
    assert demo_mcp.resolve("url: ${TETHER_DEMO_MCP_URL}", None) == "url: ${TETHER_DEMO_MCP_URL}"
