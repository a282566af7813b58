"""Which agent takes a run: each agent's routes, the most specific match, the tenant's default."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Tether's inbound sources (admission's adapters make an event of each); a route naming another
# could never match, so the schema refuses it.
SOURCES: tuple[str, ...] = ("chat", "messaging", "task", "decision")


@dataclass(frozen=True, slots=True)
class Route:
    """The runs an agent takes: from `source` on `channel`; "" matches any."""

    source: str = ""
    channel: str = ""

    @property
    def specificity(self) -> int:
        """3 for source and channel, 2 for source alone, 1 for channel alone, 0 for neither."""
        return (2 if self.source else 0) + (1 if self.channel else 0)

    def matches(self, source: str, channel: str) -> bool:
        """Whether a run from `source` on `channel` is one of this route's."""
        return (not self.source or self.source == source) and (
            not self.channel or self.channel == channel
        )

    def to_json(self) -> dict[str, str]:
        """The document's form: an omitted field matches any."""
        return {k: v for k, v in (("source", self.source), ("channel", self.channel)) if v}


def pick(
    agents: Iterable[tuple[str, Sequence[Route]]], default: str | None, source: str, channel: str
) -> str | None:
    """The agent whose matching route is most specific; else `default`; None if neither.
    Equal routes of two agents are refused when stored (`route_conflicts`), so two matches of
    one specificity cannot happen there; should they, the first agent by name wins, never an
    arbitrary one."""
    best: tuple[int, str] | None = None
    for name, routes in agents:
        for route in routes:
            if not route.matches(source, channel):
                continue
            # Higher specificity first, then the smaller name: a total order.
            if best is None or (-route.specificity, name) < (-best[0], best[1]):
                best = (route.specificity, name)
    return default if best is None else best[1]


def route_conflicts(
    agents: Iterable[tuple[str, Sequence[Route]]],
) -> list[tuple[str, str, Route]]:
    """Each pair of agents declaring an equal route, as (first declarer, second, route) in the
    order given: the store refuses them, naming both."""
    first_by_route: dict[Route, list[str]] = {}
    conflicts: list[tuple[str, str, Route]] = []
    for name, routes in agents:
        for route in dict.fromkeys(routes):
            holders = first_by_route.setdefault(route, [])
            conflicts.extend((other, name, route) for other in holders if other != name)
            if name not in holders:
                holders.append(name)
    return conflicts
