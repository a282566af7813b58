"""Gateway settings (env prefix TETHER_GATEWAY_)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from tether.settings import PlatformSettings


class GatewaySettings(PlatformSettings):
    """Gateway's settings."""

    model_config = SettingsConfigDict(env_prefix="TETHER_GATEWAY_", frozen=True, extra="ignore")

    pool_size: int = Field(5, description="Database connections (API key lookups).")
    key_cache_ttl_s: float = Field(10.0, description="How long a verified key is trusted.")
    grace_s: float = Field(5.0, description="Drain period on SIGTERM.")
