"""Orchestrator settings (env prefix TETHER_ORCHESTRATOR_)."""

from __future__ import annotations

from pydantic import AliasChoices, Field
from pydantic_settings import SettingsConfigDict

from tether.settings import RetainingSettings


class OrchestratorSettings(RetainingSettings):
    """Orchestrator's settings."""

    model_config = SettingsConfigDict(
        env_prefix="TETHER_ORCHESTRATOR_", frozen=True, extra="ignore"
    )

    pool_size: int = Field(10, description="Database connections.")
    lease_ttl_s: float = Field(10.0, description="Lease lifetime; workers heartbeat well within.")
    claim_poll_s: float = Field(
        0.5,
        description="How often waiting claims are checked for work no wake-up announced, "
        "while this replica hears no wake-ups through Redis (it is away, or was).",
    )
    claim_poll_hinted_s: float = Field(
        5.0,
        description="The same check while wake-ups are heard through Redis: only one its "
        "sender failed to publish can be missed then.",
    )
    reap_interval_s: float = Field(
        1.0,
        description="Least time between reaper rounds; a round sleeps until the earliest "
        "lease expires, at most a lease TTL (a lease granted meanwhile lasts that long).",
    )
    retry_poll_s: float = Field(
        10.0,
        description="Longest wait between looks for due retries, for those scheduled by a "
        "replica that went away before they were due; a retry this replica schedules is "
        "queued when due, not at the next look.",
    )
    grace_s: float = Field(5.0, description="Drain period on SIGTERM.")
    keepalive_interval_s: float = Field(
        0.0,
        description="How often a worker on a Work stream renews its leases; 0: a quarter of "
        "lease_ttl_s, so that a lost keepalive or two never loses a lease.",
    )
    progress_deadline_s: float = Field(
        120.0,
        description="How long an attempt may go without progress (a model event or a landed "
        "write) before its lease is no longer renewed: its worker cancels it and the reaper "
        "requeues the run. Above the longest tool call a run may make.",
    )
    render_timeout_s: float = Field(
        5.0,
        description="How long a render of an agent (tether agents render) waits for the worker "
        "it was pushed to; past it the caller is told UNAVAILABLE.",
    )
    max_connection_age_s: float = Field(
        600.0,
        description="A Work stream's connection is asked to go away (GOAWAY) after this long, "
        "so workers rebalance across replicas; they reconnect and carry on.",
    )
    model_limits: str = Field(
        "",
        validation_alias=AliasChoices("TETHER_MODEL_LIMITS", "TETHER_ORCHESTRATOR_MODEL_LIMITS"),
        description="Model rate limits per provider credential and model, shared by every "
        "worker: `[CREDENTIAL/]MODEL: requests=N, input_tokens=N, output_tokens=N[, "
        "window=S]` entries separated by `;` (see Model rate limits); `*:` learns them from "
        "the provider's headers alone. Empty: off, and workers reserve nothing.",
    )
    model_limit_recheck_s: float = Field(
        1.0,
        description="Longest a run refused by a model rate limit waits while other calls "
        "hold reservations: they give back what they do not use when they settle.",
    )
    model_limit_share: float = Field(
        1.0,
        description="This replica's share of every model limit (1 / the replicas running).",
    )
    max_connection_age_grace_s: float = Field(
        30.0, description="How long a connection that was asked to go away may finish."
    )
