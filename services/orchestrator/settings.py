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
    grace_s: float = Field(5.0, description="Drain period on SIGTERM.")
