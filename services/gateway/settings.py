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
    http_port: int = Field(
        0, description="Port of the HTTP/SSE bridge for browsers; 0 picks a free one."
    )
    stream_buffer: int = Field(
        1024,
        description="Live events buffered per stream; a client further behind is ended with "
        "its resume cursor (RESOURCE_EXHAUSTED) instead of holding anyone up.",
    )
    keepalive_interval_s: float = Field(
        5.0,
        description="A quiet stream gets a keepalive (and re-checks PostgreSQL) this often.",
    )
    poll_interval_s: float = Field(
        0.25, description="While Redis is unavailable, streams re-read PostgreSQL this often."
    )
    stream_page_size: int = Field(
        2000, description="Events per PostgreSQL read when a stream catches up (max 5000)."
    )
    conversation_poll_s: float = Field(
        1.0, description="How often a conversation stream looks for new runs."
    )
    subscription_linger_s: float = Field(
        5.0,
        description="A run's Redis subscription outlives its last stream this long, so a "
        "refreshing client finds it live.",
    )
