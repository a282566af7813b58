"""Service credentials: each internal service has its own, and each server knows only verifiers.

A calling service presents its own secret (TETHER_SERVICE_CREDENTIAL) on every internal call. A
server holds only the SHA-256 of each caller's secret (TETHER_SERVICE_VERIFIERS,
`name=hexdigest,...`), so it learns who calls and a compromised service cannot present another
one's credential. `POWERS` says which caller may call which method of which internal service;
a method it does not list is refused to everyone.
"""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
from collections.abc import Iterable, Mapping

CREDENTIAL_KEY = "x-tether-service-credential"
CREDENTIAL_ENV = "TETHER_SERVICE_CREDENTIAL"
VERIFIERS_ENV = "TETHER_SERVICE_VERIFIERS"
# The secret store's keys (services.interactions.sealing): interactions' alone, never another
# service's, so no other process can open a sealed secret.
SECRETS_KEY_ENV = "TETHER_SECRETS_KEY"
# AES-256.
SECRETS_KEY_BYTES = 32

# The services that call others, and so hold a credential of their own.
CALLERS = ("gateway", "worker", "interactions", "orchestrator")
# The services whose gRPC servers take internal calls, and so need their callers' verifiers.
SERVERS = ("admission", "orchestrator", "interactions")

_WORKER_ON_ORCHESTRATOR = frozenset(
    {
        "Work",
        # The unary calls: the previous release's workers use them during a rolling deploy.
        "ClaimRun",
        "Heartbeat",
        "Checkpoint",
        "CompleteRun",
        "ParkRun",
        "ScheduleRetry",
        "ReleaseRun",
        "BeginEffect",
        "FinishEffect",
        "StoreToolOutput",
        "RetrieveKnowledge",
        "StoreSummary",
        "BeginDelivery",
        "RecordDelivery",
        "FindChannelStatus",
    }
)
_WORKER_ON_INTERACTIONS = frozenset(
    {
        "AskQuestions",
        "FindAnsweredQuestions",
        "CheckGrant",
        "RequestApproval",
        "ClaimApproval",
        "RequestConnection",
        "ResolveConnection",
        # A channel run's sending credential, for its one delivery (under the run's lease).
        "LookupChannelDelivery",
        "RevealRunSecret",
    }
)

# Internal service -> caller -> the methods that caller may call (read from who calls what).
POWERS: Mapping[str, Mapping[str, frozenset[str]]] = {
    "tether.v1.AdmissionService": {
        "gateway": frozenset(
            {
                "Admit",
                "AdmitStream",
                "ReclaimRun",
                "DeleteTenantEvents",
                "CreateSchedule",
                "SearchSchedules",
                "SetSchedulePaused",
                "DeleteSchedule",
            }
        )
    },
    "tether.v1.OrchestratorService": {
        "gateway": frozenset(
            {
                "LookupRun",
                "SearchRuns",
                "ReadEvents",
                "RequestCancellation",
                "StoreDocument",
                "FindDocuments",
                "DeleteDocument",
                "LookupAttempts",
                "DeleteTenantRuns",
                "PublishAgent",
                "LookupAgent",
                "SearchAgents",
                "LookupAgentVersions",
                "RepublishAgent",
                "ChooseDefaultAgent",
                "DeleteAgent",
                "ListCatalogTools",
                "AgentRender",
                # What a verified channel webhook reports of messages sent (WhatsApp statuses).
                "RecordChannelStatuses",
                "CreateWebhookSubscription",
                "SearchWebhookSubscriptions",
                "DeleteWebhookSubscription",
                "SearchWebhookDeliveries",
                "RequeueWebhookDelivery",
            }
        ),
        "worker": _WORKER_ON_ORCHESTRATOR,
        "interactions": frozenset(
            # LookupBinding: deprecated, for the previous release's replicas (see the proto).
            {"ResumeRun", "ExpireWaitingRun", "LookupRunFacts", "LookupBinding"}
        ),
    },
    "tether.v1.InteractionsService": {
        "gateway": frozenset(
            {
                "FindPendingQuestion",
                "RecordAnswers",
                "FindPendingApproval",
                "RecordDecision",
                "FindPendingConnection",
                "ConfirmConnection",
                "DeleteTenantInteractions",
                "AddSecret",
                "ListSecrets",
                "RemoveSecret",
                "AddChannel",
                "ListChannels",
                "GetChannel",
                "RemoveChannel",
                "RotateChannelSecret",
                # The gateway verifies providers' webhooks; no other service may read a
                # connection's verification secrets.
                "LookupChannelVerification",
            }
        ),
        "worker": _WORKER_ON_INTERACTIONS,
        # Run-event webhook subscriptions are the orchestrator's: it alone seals and opens
        # their signing secrets.
        "orchestrator": frozenset(
            {"SealWebhookSecret", "OpenWebhookSecret", "DiscardWebhookSecret"}
        ),
    },
}


class CredentialMissing(SystemExit):
    """A service started without the credential it needs; it exits with this message."""


def new_credential() -> str:
    """A fresh service credential (256 random bits)."""
    return secrets.token_urlsafe(32)


def verifier(credential: str) -> str:
    """What a server stores of a caller's credential: its SHA-256, in hex."""
    return hashlib.sha256(credential.encode()).hexdigest()


def format_verifiers(credentials: Mapping[str, str]) -> str:
    """The TETHER_SERVICE_VERIFIERS value for these callers' credentials."""
    return ",".join(f"{name}={verifier(secret)}" for name, secret in sorted(credentials.items()))


def parse_verifiers(text: str) -> dict[str, str]:
    """Verifier (hex digest) -> caller name, from `name=hexdigest,...`; raises ValueError."""
    found: dict[str, str] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        name, _, digest = entry.partition("=")
        if not name or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(
                f"{VERIFIERS_ENV} entry {entry[:20]!r}... is not name=<sha256 hex of the "
                "caller's credential>"
            )
        found[digest] = name
    return found


def generate(names: Iterable[str] = CALLERS) -> dict[str, str]:
    """A new credential for each calling service (the embedded stack and the test fixtures)."""
    return {name: new_credential() for name in names}


def service_env(credentials: Mapping[str, str], service: str) -> dict[str, str]:
    """The credential environment of one service: its own secret (when it calls others) and
    every caller's verifier."""
    env = {VERIFIERS_ENV: format_verifiers(credentials)}
    if service in credentials:
        env[CREDENTIAL_ENV] = credentials[service]
    return env


def require_credential(service: str, credential: str) -> str:
    """`credential`, or exit with a message saying how to configure it."""
    if not credential:
        raise CredentialMissing(
            f"{service}: no service credential configured; set {CREDENTIAL_ENV} to this "
            "service's own secret (every service has its own; `tether up` and the test "
            "fixtures generate them)"
        )
    return credential


def require_verifiers(service: str, text: str) -> dict[str, str]:
    """The parsed verifiers of the callers this server accepts, or exit saying what is wrong."""
    try:
        verifiers = parse_verifiers(text)
    except ValueError as exc:
        raise CredentialMissing(f"{service}: {exc}") from None
    if not verifiers:
        raise CredentialMissing(
            f"{service}: no caller verifiers configured; set {VERIFIERS_ENV} to "
            "name=<sha256 hex of that service's credential>,... for the services that call it"
        )
    return verifiers


def new_secrets_key(key_id: str = "dev1") -> str:
    """A TETHER_SECRETS_KEY value holding one fresh key: `KEYID:base64key`."""
    return f"{key_id}:{base64.b64encode(os.urandom(SECRETS_KEY_BYTES)).decode()}"
