"""Settings shared by every service: where PostgreSQL, Redis and the other services are.

Each service's own settings class extends `PlatformSettings` with its env prefix; the shared
fields keep their global names (TETHER_DATABASE_URL, ...) so one environment serves the stack.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tether.targets import SETTING as TARGETS_SETTING
from tether.targets import TargetPolicy

# The prefix of the settings meant for the tools and context providers a worker loads: they are
# given these and nothing else of its environment (`services.worker.plugins`).
TOOL_PREFIX = "TETHER_TOOL_"


def _env(name: str) -> AliasChoices:
    return AliasChoices(name)


class PlatformSettings(BaseSettings):
    """Connection settings every service reads."""

    model_config = SettingsConfigDict(frozen=True, extra="ignore")

    database_url: str = Field(
        "", validation_alias=_env("TETHER_DATABASE_URL"), description="PostgreSQL URL."
    )
    redis_url: str = Field("", validation_alias=_env("TETHER_REDIS_URL"), description="Redis URL.")
    service_credential: str = Field(
        "",
        validation_alias=_env("TETHER_SERVICE_CREDENTIAL"),
        description="This service's own secret, presented when it calls another service "
        "(required by the services that call others).",
    )
    service_verifiers: str = Field(
        "",
        validation_alias=_env("TETHER_SERVICE_VERIFIERS"),
        description="name=<sha256 hex of that caller's credential>,... for every service "
        "that may call this one (required by the services that serve internal calls).",
    )
    host: str = Field("127.0.0.1", description="Interface the gRPC server binds.")
    port: int = Field(0, description="gRPC port; 0 picks a free one.")
    admission_addr: str = Field(
        "", validation_alias=_env("TETHER_ADMISSION_ADDR"), description="Admission host:port."
    )
    orchestrator_addr: str = Field(
        "", validation_alias=_env("TETHER_ORCHESTRATOR_ADDR"), description="Orchestrator host:port."
    )
    interactions_addr: str = Field(
        "", validation_alias=_env("TETHER_INTERACTIONS_ADDR"), description="Interactions host:port."
    )
    ready_file: str = Field(
        "",
        validation_alias=_env("TETHER_READY_FILE"),
        description="When set, the bound port is written here once the server serves.",
    )
    log_level: str = Field(
        "INFO", validation_alias=_env("TETHER_LOG_LEVEL"), description="Least level logged."
    )
    log_format: Literal["json", "text"] = Field(
        "json",
        validation_alias=_env("TETHER_LOG_FORMAT"),
        description="json: one JSON object a line on stderr, with the tenant, run, attempt and "
        "trace ids of what it is about; text: one readable line, for a terminal.",
    )
    otlp_endpoint: str = Field(
        "",
        validation_alias=_env("OTEL_EXPORTER_OTLP_ENDPOINT"),
        description="OpenTelemetry collector (OTLP over gRPC, e.g. http://collector:4317): "
        "traces and metrics are exported there; empty turns telemetry off at no cost. The "
        "exporter honours the other standard OTEL_* variables (headers, timeouts, batch and "
        "export intervals).",
    )
    telemetry_tenants: str = Field(
        "",
        validation_alias=_env("TETHER_TELEMETRY_TENANTS"),
        description="Comma-separated tenant ids that get a metric label of their own; every "
        "other tenant is counted as `other`, so the label stays bounded.",
    )
    telemetry_content: bool = Field(
        False,
        validation_alias=_env("TETHER_TELEMETRY_CONTENT"),
        description="Record message text, model output and tool inputs on spans. Off: spans and "
        "logs carry ids, counts and timings only, never what people or the model wrote.",
    )
    allow_private_targets: str = Field(
        "",
        validation_alias=_env(TARGETS_SETTING),
        description="The non-public addresses a tenant's outbound URL (a channel's "
        "api_base_url or reply-url, a run-event webhook) may reach, checked when configured and "
        "again on every connection: empty, public addresses only; else a comma-separated list "
        "of loopback (127/8, ::1), private (RFC 1918, fc00::/7, 100.64/10), link-local "
        "(169.254/16 with the cloud metadata endpoint, fe80::/10), or all. Unspecified, "
        "multicast and reserved addresses are never reached. `tether up` sets loopback.",
    )
    health_port: int | None = Field(
        None,
        description="A second, plaintext port serving only gRPC health, for probes that speak "
        "no TLS (the kubelet's); unset: health on the gRPC port only. 0 picks a free one.",
    )
    schema_poll_s: float = Field(
        1.0,
        gt=0,
        validation_alias=_env("TETHER_SCHEMA_POLL_S"),
        description="While the database's schema is behind the migrations this release ships, "
        "the service reports NOT_SERVING and looks again this often.",
    )
    tls_ca_file: str = Field(
        "",
        validation_alias=_env("TETHER_TLS_CA_FILE"),
        description="PEM file of the CA that signs every internal service's certificate. Set, "
        "internal gRPC is mutual TLS: servers require a client certificate it signed, channels "
        "verify servers against it. Empty: plaintext (the loopback stack).",
    )
    tls_server_cert_file: str = Field(
        "",
        validation_alias=_env("TETHER_TLS_SERVER_CERT_FILE"),
        description="PEM certificate chain this service's gRPC server presents (with a CA).",
    )
    tls_server_key_file: str = Field(
        "",
        validation_alias=_env("TETHER_TLS_SERVER_KEY_FILE"),
        description="PEM private key of the server certificate.",
    )
    tls_client_cert_file: str = Field(
        "",
        validation_alias=_env("TETHER_TLS_CLIENT_CERT_FILE"),
        description="PEM certificate chain this service presents when it calls another one.",
    )
    tls_client_key_file: str = Field(
        "",
        validation_alias=_env("TETHER_TLS_CLIENT_KEY_FILE"),
        description="PEM private key of the client certificate.",
    )

    @field_validator("allow_private_targets")
    @classmethod
    def _a_policy(cls, value: str) -> str:
        # A misspelt class fails at startup, not at the first tenant's URL.
        TargetPolicy.parse(value)
        return value

    @property
    def target_policy(self) -> TargetPolicy:
        """The outbound-target policy `allow_private_targets` names."""
        return TargetPolicy.parse(self.allow_private_targets)


class RetainingSettings(PlatformSettings):
    """The retention sweep's settings, for the services that own what a tenant's retention
    policy removes (`tether.retention`): the orchestrator and admission."""

    retention_batch: int = Field(
        500,
        gt=0,
        description="Rows the retention sweep examines per statement, so that no statement "
        "holds many locks or runs long (tenants' policies: tether.retention).",
    )
    retention_interval_s: float = Field(
        1.0,
        gt=0,
        description="Least time between two retention rounds; a round sleeps until something is "
        "next due to expire, at most retention_poll_s.",
    )
    retention_poll_s: float = Field(
        300.0,
        gt=0,
        description="Longest wait between retention rounds: how soon a tenant's changed "
        "policy is seen.",
    )
    retention_repass_s: float = Field(
        3600.0,
        gt=0,
        description="How soon retention looks again, from the oldest, at expired rows it had to "
        "keep (a live conversation's history, a run another run retried, a message whose run "
        "is kept).",
    )
