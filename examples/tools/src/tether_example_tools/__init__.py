"""Two small tools, as a team would write them for Tether.

- `lookup_order` reads: no approval, no effects record.
- `create_ticket` writes to an external system (the `TicketDesk`, a stand-in kept in memory):
  it is `publish` risk, so it runs only once a person approved it (or under a standing grant),
  and it writes externally, so every call carries an idempotency key the desk deduplicates on.

The package's `tether.tools` entry point names `toolkit`; the worker loads it at startup and
announces both tools in its hello, so `tether tools list` shows them and an agent may name them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Annotated

from pydantic import BaseModel, Field

from tether.tools import RiskCategory, Tool, ToolContext, ToolError, Toolkit, tool, tools_of

# Read by the factory below from the worker's TETHER_TOOL_... settings.
TICKET_PREFIX_SETTING = "TETHER_TOOL_TICKET_PREFIX"

ORDERS = {
    "ORD-1001": ("shipped", "2 x desk lamp"),
    "ORD-1002": ("packing", "1 x office chair"),
    "ORD-1003": ("delivered", "3 x notebook"),
}


class OrderStatus(BaseModel):
    """What `lookup_order` answers."""

    order_id: str
    status: str
    items: str


@tool
async def lookup_order(
    order_id: Annotated[str, Field(description="The order's id, like ORD-1001", pattern="^ORD-")],
) -> OrderStatus:
    """Looks up an order by its id and returns its status and items."""
    found = ORDERS.get(order_id)
    if found is None:
        # An expected failure, worded so the model can fix its call or tell the person.
        raise ToolError(f"no order {order_id}; known orders look like ORD-1001")
    status, items = found
    return OrderStatus(order_id=order_id, status=status, items=items)


class Severity(Enum):
    LOW = "low"
    HIGH = "high"


@dataclass(frozen=True)
class Ticket:
    """A ticket the desk holds."""

    id: str
    title: str
    severity: str
    idempotency_key: str


@dataclass
class TicketDesk:
    """The external system `create_ticket` writes to (in memory here), and the class form of a
    tool: the desk's state lives on the instance, and each `@tool` method is a tool bound to it."""

    prefix: str = "TCK"
    tickets: dict[str, Ticket] = field(default_factory=dict)

    @tool(risk=RiskCategory.PUBLISH, writes_externally=True, timeout_s=10)
    async def create_ticket(
        self,
        ctx: ToolContext,
        title: Annotated[str, Field(description="One line: what is wrong", min_length=3)],
        severity: Severity = Severity.LOW,
        order_id: Annotated[str | None, "The order it is about, if any"] = None,
    ) -> str:
        """Opens a support ticket and returns its id."""
        key = ctx.idempotency_key
        if key is None:
            # Fail closed: without a key a retried call would open a second ticket.
            raise ToolError("create_ticket needs an idempotency key and was called without one")
        # A real desk takes the key as a header and answers a repeat with the first ticket.
        ticket = self.tickets.get(key)
        if ticket is None:
            ticket = Ticket(f"{self.prefix}-{len(self.tickets) + 1}", title, severity.value, key)
            self.tickets[key] = ticket
        about = f" about {order_id}" if order_id else ""
        return f"opened ticket {ticket.id}{about}: {title} ({ticket.severity})"


def _configured(settings: Mapping[str, str]) -> list[Tool]:
    return tools_of(TicketDesk(prefix=settings.get(TICKET_PREFIX_SETTING, "TCK")))


toolkit = Toolkit(lookup_order, factory=_configured)
