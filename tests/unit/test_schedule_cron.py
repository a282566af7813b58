"""Schedules' time arithmetic (services.admission.cron): a cron read in its timezone across
daylight-saving transitions, and which ticks each catch-up policy fires after an outage."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from services.admission.cron import (
    MAX_CATCH_UP_TICKS,
    CatchUp,
    Cron,
    parse_overlap,
    plan,
)
from tether.errors import InvalidArgument

PARIS = "Europe/Paris"
GRACE_S = 60.0


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def minutes(n: int) -> timedelta:
    return timedelta(minutes=n)


@pytest.mark.parametrize(
    ("cron", "timezone", "field", "named"),
    [
        ("61 * * * *", "UTC", "cron", "does not parse"),
        ("* * *", "UTC", "cron", "five fields"),
        ("0 0 30 2 *", "UTC", "cron", "does not parse"),
        ("", "UTC", "cron", "required"),
        ("0 9 * * 1-5", "Europe/Atlantis", "timezone", "does not exist"),
        ("0 9 * * 1-5", "../../etc/passwd", "timezone", "does not exist"),
    ],
)
def test_a_bad_cron_or_timezone_is_invalid_argument_naming_the_field(
    cron: str, timezone: str, field: str, named: str
) -> None:
    with pytest.raises(InvalidArgument) as refused:
        Cron.parse(cron, timezone)
    assert refused.value.details == {"field": field}
    assert named in refused.value.message


def test_unknown_policies_and_windows_are_refused_naming_what_is_allowed() -> None:
    with pytest.raises(InvalidArgument, match=r"latest .* none, or all"):
        CatchUp.parse("burst", 0)
    with pytest.raises(InvalidArgument, match="1 to 604800"):
        CatchUp.parse("all", 8 * 86_400)
    with pytest.raises(InvalidArgument, match=r"skip .* or allow"):
        parse_overlap("queue")
    assert CatchUp.parse("", 0) == CatchUp("latest", 3600)
    assert parse_overlap("") == "skip"


def test_weekday_mornings_in_paris_are_nine_local_in_winter_and_summer() -> None:
    cron = Cron.parse("0 9 * * 1-5", PARIS)
    # Friday 2026-01-09 10:00 Paris (09:00 UTC): next is Monday 12 January, 09:00 CET (UTC+1).
    assert cron.next_after(utc(2026, 1, 9, 9, 0)) == utc(2026, 1, 12, 8, 0)
    # In July Paris is UTC+2.
    assert cron.next_after(utc(2026, 7, 3, 12, 0)) == utc(2026, 7, 6, 7, 0)


def test_a_tick_in_the_hour_spring_forward_skips_fires_once_just_after_it() -> None:
    # 29 March 2026: Paris jumps from 02:00 to 03:00 CEST (01:00 UTC); 02:30 does not exist.
    cron = Cron.parse("30 2 * * *", PARIS)
    first = cron.next_after(utc(2026, 3, 28, 12, 0))
    assert first == utc(2026, 3, 29, 1, 0)  # 03:00 CEST, the first minute after the gap
    assert cron.next_after(first) == utc(2026, 3, 30, 0, 30)  # 02:30 CEST again


def test_a_daily_tick_in_the_hour_autumn_repeats_fires_once() -> None:
    # 25 October 2026: Paris goes from 03:00 CEST back to 02:00 CET; 02:30 happens twice.
    cron = Cron.parse("30 2 * * *", PARIS)
    first = cron.next_after(utc(2026, 10, 24, 12, 0))
    assert first == utc(2026, 10, 25, 0, 30)  # 02:30 CEST
    assert cron.next_after(first) == utc(2026, 10, 26, 1, 30)  # next day, 02:30 CET


def test_an_hourly_cron_fires_in_both_repeated_hours_an_hour_apart() -> None:
    cron = Cron.parse("0 * * * *", PARIS)
    ticks = cron.ticks_between(utc(2026, 10, 24, 23, 0), utc(2026, 10, 25, 2, 0), limit=10)
    assert ticks == [utc(2026, 10, 24, 23, 0), utc(2026, 10, 25, 0, 0), utc(2026, 10, 25, 1, 0),
                     utc(2026, 10, 25, 2, 0)]  # fmt: skip
    # 00:00 and 01:00 UTC are 02:00 CEST and 02:00 CET: the same wall-clock hour, twice.


def test_the_latest_tick_at_or_before_includes_the_minute_itself() -> None:
    cron = Cron.parse("* * * * *", "UTC")
    assert cron.latest_at_or_before(utc(2026, 1, 1, 9, 0)) == utc(2026, 1, 1, 9, 0)
    at = utc(2026, 1, 1, 9, 0) + timedelta(seconds=59.5)
    assert cron.latest_at_or_before(at) == utc(2026, 1, 1, 9, 0)


# A schedule every minute whose tick at 09:01 fired; no ticker ran until 09:04:30, so the ticks
# of 09:02, 09:03 and 09:04 were missed (a three-minute outage).
EVERY_MINUTE = Cron.parse("* * * * *", "UTC")
DUE = utc(2026, 1, 1, 9, 2)
AFTER_OUTAGE = utc(2026, 1, 1, 9, 4, 30)


def test_latest_fires_one_run_for_the_most_recent_missed_tick() -> None:
    planned = plan(EVERY_MINUTE, CatchUp("latest"), DUE, AFTER_OUTAGE, GRACE_S)
    assert planned.fire == [utc(2026, 1, 1, 9, 4)]
    assert planned.passed_over == 2
    assert planned.next_fire_at == utc(2026, 1, 1, 9, 5)


def test_latest_fires_one_run_however_long_the_outage() -> None:
    a_week_later = DUE + timedelta(days=7, seconds=10)
    planned = plan(EVERY_MINUTE, CatchUp("latest"), DUE, a_week_later, GRACE_S)
    assert planned.fire == [a_week_later.replace(second=0)]


def test_none_fires_nothing_for_missed_ticks_but_an_on_time_tick_fires() -> None:
    hourly = Cron.parse("0 * * * *", "UTC")
    due = utc(2026, 1, 1, 9, 0)
    # Down from before 09:00 until 11:30: the ticks of 09:00, 10:00 and 11:00 were missed.
    missed = plan(hourly, CatchUp("none"), due, utc(2026, 1, 1, 11, 30), GRACE_S)
    assert missed.fire == []
    assert missed.passed_over == 3
    assert missed.next_fire_at == utc(2026, 1, 1, 12, 0)
    # Back at 11:00:20: the 11:00 tick is on time (within the grace) and fires.
    on_time = plan(hourly, CatchUp("none"), due, utc(2026, 1, 1, 11, 0, 20), GRACE_S)
    assert on_time.fire == [utc(2026, 1, 1, 11, 0)]


def test_all_fires_every_missed_tick_within_the_window_oldest_first() -> None:
    everything = plan(EVERY_MINUTE, CatchUp("all", 3600), DUE, AFTER_OUTAGE, GRACE_S)
    assert everything.fire == [DUE, DUE + minutes(1), DUE + minutes(2)]
    # A two-minute window reaches back to 09:02:30: the ticks of 09:03 and 09:04.
    windowed = plan(EVERY_MINUTE, CatchUp("all", 120), DUE, AFTER_OUTAGE, GRACE_S)
    assert windowed.fire == [DUE + minutes(1), DUE + minutes(2)]
    assert windowed.passed_over == 1


def test_all_is_bounded_to_the_most_recent_ticks() -> None:
    a_week_later = DUE + timedelta(days=7)
    planned = plan(EVERY_MINUTE, CatchUp("all", 7 * 86_400), DUE, a_week_later, GRACE_S)
    assert len(planned.fire) == MAX_CATCH_UP_TICKS
    assert planned.fire[-1] == a_week_later


def test_a_schedule_not_yet_due_fires_nothing() -> None:
    planned = plan(EVERY_MINUTE, CatchUp("latest"), DUE, DUE - timedelta(seconds=1), GRACE_S)
    assert planned.fire == []
    assert planned.next_fire_at == DUE
