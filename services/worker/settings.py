"""Worker settings (env prefix TETHER_WORKER_). The worker has no database credentials."""

from __future__ import annotations

import os
import socket

from pydantic import AliasChoices, Field
from pydantic_settings import SettingsConfigDict

from tether.settings import PlatformSettings


class WorkerSettings(PlatformSettings):
    """The worker's settings."""

    model_config = SettingsConfigDict(env_prefix="TETHER_WORKER_", frozen=True, extra="ignore")

    worker_id: str = Field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
        description="Lease owner name; unique per process.",
    )
    concurrency: int = Field(8, description="Attempts this process runs at once.")
    checkpoint_interval_s: float = Field(
        0.25,
        description="Longest time streamed progress stays unpersisted; a streaming part over "
        "2,048 characters is stored again only once it has grown by a quarter.",
    )
    grace_s: float = Field(10.0, description="On SIGTERM: time for in-flight attempts to end.")
    anthropic_base_url: str = Field("", description="Messages API base URL; empty = the SDK's.")
    anthropic_api_key: str = Field("", description="API key; empty = ANTHROPIC_API_KEY.")
    provider_timeout_s: float = Field(
        600.0, description="Read timeout of one model call (the longest gap between bytes)."
    )
    delivery_reconcile_s: float = Field(
        30.0,
        validation_alias=AliasChoices(
            "TETHER_DELIVERY_RECONCILE_S", "TETHER_WORKER_DELIVERY_RECONCILE_S"
        ),
        description="How long a WhatsApp answer that may have been sent before a crash waits "
        "for the status callback that names it (TETHER_DELIVERY_RECONCILE_S) before it is sent "
        "again.",
    )
    # 64 MiB: a 50-run history of chat turns is tens of kilobytes, so thousands of sessions.
    history_cache_bytes: int = Field(
        64 << 20,
        description="Bytes of sessions' histories kept between leases (least recently used "
        "forgotten first), so a long conversation's lease carries only what is new; 0 keeps "
        "none (every lease carries its whole history).",
    )
    mcp_call_timeout_s: float = Field(
        30.0,
        description="Longest wait for an MCP server's answer to one tool call; past it the "
        "call ends tool_outcome_unknown (it may have run) and a retry re-sends its key.",
    )
