"""Schedules' time arithmetic: a cron expression read in an IANA timezone, its ticks (cronsim does
the daylight-saving arithmetic: a tick in the hour a spring transition skips fires at the first
minute after it, a tick in the hour an autumn transition repeats fires once, an hourly one in
both), and which of the ticks a ticker finds passed it admits under a catch-up policy.

Pure: every instant in and out is an aware UTC datetime, and "now" is always an argument."""

from __future__ import annotations

import functools
import zoneinfo
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from cronsim import CronSim, CronSimError

from tether.errors import InvalidArgument

OVERLAPS = ("skip", "allow")
CATCH_UPS = ("latest", "none", "all")
DEFAULT_OVERLAP = "skip"
DEFAULT_CATCH_UP = "latest"
DEFAULT_CATCH_UP_WINDOW_S = 3600
# A week: an outage longer than that is an incident to look at, not a backlog to replay.
MAX_CATCH_UP_WINDOW_S = 7 * 86_400
# What "all" admits at most in one catch-up (the most recent ones): a minutely cron over a
# week's window would otherwise be ten thousand runs in one transaction.
MAX_CATCH_UP_TICKS = 1000
_MINUTE = timedelta(minutes=1)


@functools.cache
def _zones() -> frozenset[str]:
    """The IANA names this host's tz database holds (read once)."""
    return frozenset(zoneinfo.available_timezones())


@dataclass(frozen=True)
class Cron:
    """A five-field cron expression read in an IANA timezone."""

    expression: str
    timezone: str

    @classmethod
    def parse(cls, expression: str, timezone: str) -> Cron:
        """The cron, or InvalidArgument naming what is wrong with it (empty timezone: UTC)."""
        expression = " ".join(expression.split())
        timezone = timezone.strip() or "UTC"
        if timezone not in _zones():
            raise InvalidArgument(
                f"timezone {timezone[:64]!r} does not exist; use an IANA name such as "
                "'Europe/Paris', 'America/New_York' or 'UTC'",
                details={"field": "timezone"},
            )
        if not expression:
            raise InvalidArgument(
                "cron is required: five fields, minute hour day-of-month month day-of-week "
                "(e.g. '0 9 * * 1-5')",
                details={"field": "cron"},
            )
        try:
            CronSim(expression, datetime.now(UTC))
        except CronSimError as exc:
            raise InvalidArgument(
                f"cron {expression[:80]!r} does not parse ({exc}); write five fields, minute "
                "hour day-of-month month day-of-week, e.g. '0 9 * * 1-5'",
                details={"field": "cron"},
            ) from None
        return cls(expression, timezone)

    @property
    def _zone(self) -> zoneinfo.ZoneInfo:
        return zoneinfo.ZoneInfo(self.timezone)

    def next_after(self, instant: datetime) -> datetime:
        """The first tick strictly after `instant`."""
        local = instant.astimezone(self._zone)
        return next(CronSim(self.expression, local)).astimezone(UTC)

    def latest_at_or_before(self, instant: datetime) -> datetime:
        """The last tick at or before `instant`."""
        # Reversed, cronsim yields ticks strictly before its start; a tick is a whole minute,
        # so one second past the minute `instant` falls in includes that minute's.
        minute = instant.astimezone(self._zone).replace(second=0, microsecond=0)
        start = minute + timedelta(seconds=1)
        return next(CronSim(self.expression, start, reverse=True)).astimezone(UTC)

    def ticks_between(self, first: datetime, last: datetime, *, limit: int) -> list[datetime]:
        """The ticks t with first <= t <= last, the most recent `limit` of them, oldest first."""
        ticks: list[datetime] = []
        tick = self.latest_at_or_before(last)
        reverse = CronSim(self.expression, tick.astimezone(self._zone), reverse=True)
        while tick >= first and len(ticks) < limit:
            ticks.append(tick)
            tick = next(reverse).astimezone(UTC)
        ticks.reverse()
        return ticks


@dataclass(frozen=True)
class CatchUp:
    """A schedule's catch-up policy: "latest", "none" or "all" within `window_s`."""

    policy: str = DEFAULT_CATCH_UP
    window_s: int = DEFAULT_CATCH_UP_WINDOW_S

    @classmethod
    def parse(cls, policy: str, window_s: int) -> CatchUp:
        """The policy (empty: latest; a window of 0: an hour), or InvalidArgument."""
        policy = policy.strip() or DEFAULT_CATCH_UP
        if policy not in CATCH_UPS:
            raise InvalidArgument(
                f"catch-up policy {policy[:16]!r} is unknown; use latest (one run for the most "
                "recent missed tick), none, or all (every missed tick within the window)",
                details={"field": "catch_up"},
            )
        window = window_s or DEFAULT_CATCH_UP_WINDOW_S
        if not 0 < window <= MAX_CATCH_UP_WINDOW_S:
            raise InvalidArgument(
                f"catch-up window must be 1 to {MAX_CATCH_UP_WINDOW_S} seconds (7 days); "
                f"got {window_s}",
                details={"field": "catch_up_window_seconds"},
            )
        return cls(policy, window)


def parse_overlap(overlap: str) -> str:
    """The overlap policy (empty: skip), or InvalidArgument."""
    overlap = overlap.strip() or DEFAULT_OVERLAP
    if overlap not in OVERLAPS:
        raise InvalidArgument(
            f"overlap policy {overlap[:16]!r} is unknown; use skip (no tick while the previous "
            "tick's run is active) or allow",
            details={"field": "overlap"},
        )
    return overlap


@dataclass(frozen=True)
class Plan:
    """What a ticker does with a due schedule: the ticks it admits (oldest first), how many it
    passes over, and the schedule's next fire time (the first tick after now)."""

    fire: list[datetime]
    passed_over: int
    next_fire_at: datetime


def plan(cron: Cron, catch_up: CatchUp, due: datetime, now: datetime, grace_s: float) -> Plan:
    """The plan for a schedule whose earliest unfired tick is `due` (<= now), at `now`.

    A tick no older than `grace_s` is on time and fires under every policy; older ones were
    missed (no ticker ran: an outage). `latest` fires the most recent tick, whatever its age
    (one run, never a burst); `none` fires only an on-time tick; `all` fires every tick within
    the window (at most MAX_CATCH_UP_TICKS, the most recent)."""
    next_fire_at = cron.next_after(now)
    latest = cron.latest_at_or_before(now)
    if latest < due:
        # Nothing between the stored time and now (the stored time came from another cron).
        return Plan([], 0, next_fire_at)
    on_time = (now - latest).total_seconds() <= grace_s
    if catch_up.policy == "all":
        first = max(due, now - timedelta(seconds=catch_up.window_s))
        fire = cron.ticks_between(first, now, limit=MAX_CATCH_UP_TICKS)
    elif catch_up.policy == "latest" or on_time:
        fire = [latest]
    else:
        fire = []
    passed = _count_ticks(cron, due, latest) - len(fire)
    return Plan(fire, passed, next_fire_at)


def _count_ticks(cron: Cron, first: datetime, last: datetime) -> int:
    """How many ticks fall in [first, last] (counted up to MAX_CATCH_UP_TICKS past the fired
    ones: a number for the log, not an exact census of a year's outage)."""
    return len(cron.ticks_between(first, last, limit=2 * MAX_CATCH_UP_TICKS))
