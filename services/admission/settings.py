"""Admission settings (env prefix TETHER_ADMISSION_)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from tether.settings import RetainingSettings


class AdmissionSettings(RetainingSettings):
    """Admission's settings; shared connection fields come from PlatformSettings."""

    model_config = SettingsConfigDict(env_prefix="TETHER_ADMISSION_", frozen=True, extra="ignore")

    max_attempts: int = Field(3, description="Attempt budget a new run starts with.")
    replay_window_s: float = Field(
        86_400.0, description="How long a completed event's outcome may be replayed."
    )
    stale_replay: str = Field(
        "refuse", description='Outside the window: "refuse" or "reprocess" (a new run).'
    )
    pool_size: int = Field(10, description="Database connections.")
    grace_s: float = Field(5.0, description="Drain period on SIGTERM.")
    max_stream_age_s: float = Field(
        600.0,
        description="A gateway's AdmitStream is asked to drain after about this long (each "
        "stream within 10% of it): the gateway opens its next stream over a new connection, "
        "so gateways rebalance across admission replicas; no call is cut short.",
    )
    stream_drain_grace_s: float = Field(
        30.0,
        description="How long a draining AdmitStream still takes calls from a gateway that has "
        "not closed its side.",
    )
    schedule_poll_s: float = Field(
        1.0, description="How often the schedule ticker looks for due schedules."
    )
    schedule_batch: int = Field(
        100, description="Schedules the ticker claims and fires in one transaction."
    )
    schedule_grace_s: float = Field(
        60.0,
        description="How late a schedule's tick may be fired and still count as on time; an "
        "older one was missed (no ticker ran) and its catch-up policy decides.",
    )
    schedule_clock_file: str = Field(
        "",
        description="Drills and tests only: the ticker reads the time from this file (one "
        "ISO-8601 instant) instead of the system clock. Empty: the system clock.",
    )
