"""`tether up`'s settings: which servers to use, how many workers, how crashed services restart."""

from __future__ import annotations

from typing import Self

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class UpSettings(BaseSettings):
    """The embedded stack's settings (env prefix TETHER_UP_ unless a field names its own)."""

    model_config = SettingsConfigDict(env_prefix="TETHER_UP_", frozen=True, extra="ignore")

    database_url: str = Field(
        "",
        validation_alias=AliasChoices("TETHER_DATABASE_URL"),
        description="A PostgreSQL to use instead of the embedded one.",
    )
    redis_url: str = Field(
        "",
        validation_alias=AliasChoices("TETHER_REDIS_URL"),
        description="A Redis to use instead of the embedded one.",
    )
    worker_redis_url: str = Field(
        "",
        description="With TETHER_REDIS_URL: the URL the workers use, a Redis user that may only "
        "PUBLISH on tether:events:* (its ACL rules: deploy/k8s/README.md). "
        "Unset, workers get no Redis and their runs stream no live deltas. The embedded Redis "
        "makes its own such user.",
    )
    workers: int = Field(
        2,
        ge=1,
        validation_alias=AliasChoices("TETHER_WORKERS"),
        description="Worker processes (two, so a crashed one never leaves runs unserved).",
    )
    agents_dir: str = Field(
        "",
        description="A folder of agent documents (*.yaml, *.json) applied as the development "
        "tenant once the workers are ready, each only while the tenant has no agent of its "
        "name (a change made since survives a restart); empty: the repository's examples/agents.",
    )
    demo_slack: bool = Field(
        True,
        description="Start the local Slack stand-in as a supervised child and give the "
        "development tenant a Slack connection named demo-slack pointing at it (added only "
        "while it has none of that name); false: neither.",
    )
    demo_mcp: bool = Field(
        True,
        description="Start the local MCP stand-in (an order desk) as a supervised child; the "
        "agent documents' ${TETHER_DEMO_MCP_URL} is its URL (examples/agents/shop.yaml); "
        "false: neither, and a document naming it is skipped.",
    )
    restart_delay_s: float = Field(
        0.5, gt=0, description="Wait before restarting a service that died; doubles each time."
    )
    restart_max_delay_s: float = Field(
        10.0, gt=0, description="Longest wait before a restart, however often it died."
    )
    restart_stable_s: float = Field(
        30.0,
        ge=0,
        description="A service that stayed up this long before dying restarts after the "
        "shortest wait again.",
    )

    @model_validator(mode="after")
    def _delays_in_order(self) -> Self:
        if self.restart_delay_s > self.restart_max_delay_s:
            raise ValueError(
                "TETHER_UP_RESTART_DELAY_S must not exceed TETHER_UP_RESTART_MAX_DELAY_S"
            )
        return self
