"""Interactions settings (env prefix TETHER_INTERACTIONS_)."""

from __future__ import annotations

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import SettingsConfigDict

from tether.settings import PlatformSettings


class InteractionsSettings(PlatformSettings):
    """The interactions service's settings."""

    model_config = SettingsConfigDict(
        env_prefix="TETHER_INTERACTIONS_", frozen=True, extra="ignore"
    )

    pool_size: int = Field(5, description="Database connections.")
    grace_s: float = Field(5.0, description="Drain period on SIGTERM.")
    approval_ttl_s: float = Field(86_400.0, description="How long an approval may wait.")
    consent_ttl_s: float = Field(900.0, description="How long a consent pause may wait.")
    sweep_interval_s: float = Field(
        1.0,
        description="Least time between two expiry, redelivery or orphan sweeps; each sleeps "
        "until its next deadline, at most the shortest TTL or the orphan grace.",
    )
    orphan_grace_s: float = Field(
        10.0,
        description="Age after which a pending interaction is checked once for its binding "
        "(parked on: confirmed; its storing lease gone without a park: orphaned).",
    )
    oauth_base_url: str = Field(
        "", description="Base URL of the demo OAuth provider ('democal'); empty: none."
    )
    oauth_redirect_uri: str = Field("", description="Where the provider sends the person back.")
    oauth_client_id: str = Field("tether-demo", description="OAuth client id.")
    mcp_oauth_client_id: str = Field(
        "tether",
        description="The client id Tether is registered under at the authorisation servers of "
        "`auth: oauth` MCP servers (a public client: PKCE, no secret); their consent sends the "
        "person back to `oauth_redirect_uri`. Empty: such servers cannot be connected.",
    )
    secrets_key: SecretStr = Field(
        SecretStr(""),
        validation_alias=AliasChoices("TETHER_SECRETS_KEY"),
        description="TETHER_SECRETS_KEY (no service prefix; only interactions is given it): "
        "`KEYID:base64key[,KEYID:base64key...]`, AES-256 keys (32 bytes); the first seals "
        "secrets and connection tokens, all open, so a key rotates by listing a new one first. "
        "Empty: the secret store and connection consents answer FAILED_PRECONDITION.",
    )
