"""The example tools under the test kit: the same path the worker runs them on (schema check,
approval, effects record, idempotency key), with memory behind the ports."""

from __future__ import annotations

from importlib.metadata import entry_points

from tether_example_tools import TicketDesk, lookup_order, toolkit

from tether.testing.tools import ToolKit
from tether.tools import tools_of


async def test_lookup_order_reads_an_order_without_approval() -> None:
    outcome = await ToolKit(lookup_order).call({"order_id": "ORD-1001"})
    assert not outcome.is_error and outcome.approval is None
    assert outcome.data == {"order_id": "ORD-1001", "status": "shipped", "items": "2 x desk lamp"}


async def test_lookup_order_refuses_a_bad_id_before_running_and_an_unknown_one_in_words() -> None:
    bad = await ToolKit(lookup_order).call({"order_id": "1001"})
    assert (bad.error_code, bad.fired) == ("tool_invalid_input", 0)
    assert "input.order_id" in bad.content
    unknown = await ToolKit(lookup_order).call({"order_id": "ORD-9"})
    assert unknown.error_code == "tool_error"
    assert unknown.content == "no order ORD-9; known orders look like ORD-1001"


async def test_create_ticket_waits_for_approval() -> None:
    (create,) = tools_of(TicketDesk())
    outcome = await ToolKit(create).call({"title": "lamp arrived broken"})
    assert outcome.paused == "paused for approval of create_ticket" and outcome.fired == 0


async def test_create_ticket_approved_once_opens_one_ticket_and_a_retry_replays() -> None:
    desk = TicketDesk(prefix="T")
    (create,) = tools_of(desk)
    kit = ToolKit(create, approval="allow-once")
    call = {"title": "lamp arrived broken", "severity": "high", "order_id": "ORD-1001"}
    first = await kit.call(call)
    assert first.content == "opened ticket T-1 about ORD-1001: lamp arrived broken (high)"
    again = await kit.call(call)
    assert again.replayed and again.fired == 0 and again.content == first.content
    assert [t.idempotency_key for t in desk.tickets.values()] == [first.idempotency_key]


async def test_create_ticket_denied_opens_nothing() -> None:
    desk = TicketDesk()
    (create,) = tools_of(desk)
    outcome = await ToolKit(create, approval="deny").call({"title": "no thanks"})
    assert outcome.error_code == "approval_deny" and desk.tickets == {}


async def test_the_entry_point_offers_both_tools_configured_from_the_settings() -> None:
    (point,) = [p for p in entry_points(group="tether.tools") if p.name == "example"]
    assert point.load() is toolkit
    tools = toolkit.tools({"TETHER_TOOL_TICKET_PREFIX": "SUP"})
    assert [t.spec.name for t in tools] == ["lookup_order", "create_ticket"]
    outcome = await ToolKit(tools[1], approval="grant").call({"title": "configured desk"})
    assert outcome.content == "opened ticket SUP-1: configured desk (low)"
