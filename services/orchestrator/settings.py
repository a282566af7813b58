"""Orchestrator settings (env prefix TETHER_ORCHESTRATOR_)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from tether.settings import PlatformSettings


class OrchestratorSettings(PlatformSettings):
    """Orchestrator's settings."""

    model_config = SettingsConfigDict(
        env_prefix="TETHER_ORCHESTRATOR_", frozen=True, extra="ignore"
    )

    pool_size: int = Field(10, description="Database connections.")
    lease_ttl_s: float = Field(10.0, description="Lease lifetime; workers heartbeat well within.")
    claim_poll_s: float = Field(
        0.5, description="How often waiting claims are checked for work no wake-up announced."
    )
    reap_interval_s: float = Field(1.0, description="How often expired leases are reaped.")
    retry_poll_s: float = Field(
        1.0,
        description="Longest wait between looks for due retries; a retry this replica "
        "schedules is queued when due, not at the next look.",
    )
    grace_s: float = Field(5.0, description="Drain period on SIGTERM.")
