"""Orchestrator settings (env prefix TETHER_ORCHESTRATOR_)."""

from __future__ import annotations

import re
from datetime import timedelta

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import SettingsConfigDict

from tether import formats
from tether.settings import RetainingSettings


class OrchestratorSettings(RetainingSettings):
    """Orchestrator's settings."""

    model_config = SettingsConfigDict(
        env_prefix="TETHER_ORCHESTRATOR_", frozen=True, extra="ignore"
    )

    pool_size: int = Field(10, description="Database connections.")
    stored_format: int = Field(
        formats.NEWEST,
        ge=formats.CURRENT,
        le=formats.NEWEST,
        description="The newest stored format this replica writes (tether.formats). Set it to "
        f"{formats.ANSWER_BY_REFERENCE} while replicas of the release before this one still run "
        "(a rolling deploy from it: the events one write appends are then stored one row each, "
        f"as that release reads them; {formats.USAGE_BY_REFERENCE} stores a completed run's "
        f"answer whole too, for the release before that, {formats.BY_REFERENCE} usage.updated "
        f"whole, and {formats.CURRENT} every event), and unset it once none does.",
    )
    claim_pool_size: int = Field(
        2,
        description="Database connections of the claims' own pool, which also reads the "
        "leased runs' histories (the lease dispatcher claims one worker's batch at a time; a "
        "unary ClaimRun takes the other).",
    )
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
        description="Longest wait between looks for due retries and due timers, for those "
        "scheduled by a replica that went away before they were due (or by another replica); "
        "a retry or timer this replica schedules is queued when due, not at the next look.",
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
    model_limit_share: float | None = Field(
        None,
        gt=0,
        le=1,
        description="This replica's share of every model limit, fixed by the operator. Unset: "
        "its connected workers over those of every live replica (model_limit_replicas), so "
        "the shares sum to 1 as replicas and workers come and go.",
    )
    model_limit_sync_s: float = Field(
        0.5,
        gt=0,
        description="How often a replica with model limits writes its buckets' levels (only "
        "while they changed) and its heartbeat and connected workers to PostgreSQL, and "
        "reads the other replicas' workers for its share. Never on a grant's path.",
    )
    model_limit_replica_timeout_s: float = Field(
        5.0,
        gt=0,
        description="A replica whose model-limit heartbeat is older than this no longer counts "
        "in the others' shares. More than model_limit_sync_s.",
    )
    max_connection_age_grace_s: float = Field(
        30.0, description="How long a connection that was asked to go away may finish."
    )
    webhook_disable_after: str = Field(
        "24h",
        validation_alias=AliasChoices("TETHER_WEBHOOK_DISABLE_AFTER"),
        description="How long a run-event webhook endpoint may fail every try before its "
        "subscription is disabled (with an audit record) and a delivery is given up: a "
        "duration such as 90s, 30m, 24h or 7d.",
    )
    webhook_poll_s: float = Field(
        1.0,
        gt=0,
        description="Longest wait between the webhook dispatcher's looks for new events of "
        "subscribed types and for due deliveries.",
    )
    webhook_waiting_poll_s: float = Field(
        10.0,
        gt=0,
        description="How often the dispatcher also looks at the runs waiting now, for a "
        "subscribed question.requested, approval.requested or connection.requested (a look "
        "reads the tenant's retained runs, about 2 us each); one whose run resumed before that "
        "look is sent when the run finishes.",
    )
    webhook_backoff_base_s: float = Field(
        5.0, gt=0, description="A webhook delivery's first retry comes this long after it failed."
    )
    webhook_backoff_max_s: float = Field(
        3600.0,
        gt=0,
        description="The longest wait between two tries of a webhook delivery (the wait "
        "doubles from webhook_backoff_base_s, less up to half at random).",
    )
    webhook_send_timeout_s: float = Field(
        10.0, gt=0, description="How long one webhook POST may take before it counts as failed."
    )
    webhook_scan_lookback_s: float = Field(
        30.0,
        ge=0,
        description="How far before its previous look the dispatcher looks again for finished "
        "runs, for events whose transaction committed late; longer than any run-finishing "
        "transaction takes.",
    )
    webhook_log_keep_s: float = Field(
        7 * 86400.0,
        ge=3600.0,
        description="How long a subscription's delivery log keeps the deliveries of a run "
        "that finished (sent or given up); at least an hour, far beyond webhook_scan_lookback_s.",
    )
    webhook_secret_ttl_s: float = Field(
        60.0,
        gt=0,
        le=60.0,
        description="How long an opened signing secret is kept in memory (at most 60 s).",
    )

    @field_validator("webhook_disable_after")
    @classmethod
    def _a_duration(cls, value: str) -> str:
        parse_duration(value)
        return value

    @property
    def webhook_disable_window(self) -> timedelta:
        """TETHER_WEBHOOK_DISABLE_AFTER as a duration."""
        return parse_duration(self.webhook_disable_after)


_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd]?)")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> timedelta:
    """A duration such as 90s, 30m, 24h, 7d (a bare number is seconds); ValueError else."""
    found = _DURATION.fullmatch(text.strip())
    if found is None:
        raise ValueError(f"{text!r} is not a duration such as 90s, 30m, 24h or 7d")
    return timedelta(seconds=float(found.group(1)) * _UNIT_SECONDS[found.group(2)])
