"""Gateway settings (env prefix TETHER_GATEWAY_)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from tether.settings import PlatformSettings

CHECKOUT = Path(__file__).resolve().parents[2]
# The promise: a revoked or expired key stops working, streams included, within this.
REVOCATION_BOUND_S = 5.0


class GatewaySettings(PlatformSettings):
    """Gateway's settings."""

    model_config = SettingsConfigDict(env_prefix="TETHER_GATEWAY_", frozen=True, extra="ignore")

    pool_size: int = Field(5, description="Database connections (API key lookups).")
    admit_timeout_s: float = Field(
        30.0,
        gt=0,
        description="How long an admission may take (at most; a caller's shorter deadline is "
        "kept): past it the call is answered UNAVAILABLE and stopped at admission, even when "
        "admission cannot answer at all (a connection gone dead without a reset).",
    )
    key_cache_ttl_s: float = Field(
        4.0,
        gt=0,
        description="How long a verified key is trusted without asking PostgreSQL again: a "
        "revoked or expired key stops working within this on every replica.",
    )
    key_recheck_s: float = Field(
        1.0,
        gt=0,
        description="How often an open stream re-verifies its key (through the cache): a "
        "stream of a revoked key ends within key_cache_ttl_s + key_recheck_s.",
    )
    operator_credential_sha256: str = Field(
        "",
        description="SHA-256 (hex) of the platform operator's credential, the only caller "
        "that creates tenants and keys across tenants; empty: no operator.",
    )
    reflection: bool = Field(
        False, description="Serve gRPC server reflection on the public port (off by default)."
    )
    grace_s: float = Field(5.0, description="Drain period on SIGTERM.")
    public_url: str = Field(
        "",
        description="The gateway's HTTP address as providers reach it (e.g. "
        "https://tether.example.com), which channel webhook URLs start with; empty: the "
        "address the HTTP bridge listens on.",
    )
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

    live_list_reread_s: float = Field(
        5.0,
        gt=0,
        description="A live run list with nothing heard re-reads its page this often (while "
        "Redis is unavailable: every second at most), so no change is missed longer.",
    )
    session_ttl_s: int = Field(
        12 * 3600,
        gt=0,
        description="How long a browser session (the console's cookie) lasts after sign-in.",
    )
    token_max_ttl_s: int = Field(
        3600,
        gt=0,
        description="The longest life a token for an embedding app may ask for (POST "
        "/v2/tokens; 300 s when it asks for none).",
    )
    cors_origins: str = Field(
        "",
        description="Comma-separated exact origins (https://app.example.com) whose pages may "
        "call /v2 across origins with a token; empty: CORS off.",
    )
    console_dir: str = Field(
        "",
        description="The web console's build directory served at /console; empty: "
        "web/console/dist in the checkout the gateway runs from.",
    )

    def console_path(self) -> Path:
        """The console's build directory."""
        return Path(self.console_dir) if self.console_dir else CHECKOUT / "web/console/dist"

    def cors_origin_list(self) -> list[str]:
        """The origins CORS is on for."""
        return [o.strip() for o in self.cors_origins.split(",") if o.strip()]

    @model_validator(mode="after")
    def _revocation_within_five_seconds(self) -> GatewaySettings:
        if self.key_cache_ttl_s + self.key_recheck_s > REVOCATION_BOUND_S:
            raise ValueError(
                "key_cache_ttl_s + key_recheck_s must not exceed "
                f"{REVOCATION_BOUND_S:g} s: a revoked key must stop working within that"
            )
        digest = self.operator_credential_sha256
        if digest and (len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest)):
            raise ValueError("operator_credential_sha256 must be 64 lowercase hex digits")
        return self
