"""What interactions are made of: the frozen types, the orchestrator and token-exchange ports,
the vocabulary of each kind, and the rules a question and its answers must keep."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tether.domain import Event, EventType, RunError, interaction_event
from tether.errors import InvalidArgument
from tether.states import RunStatus
from tether.visibility import Viewer

DECISIONS = ("allow-once", "allow-conversation", "allow-always", "deny")
ALWAYS_SCOPES = ("principal", "tenant", "category")
GAPS = ("absent", "expired", "insufficient_scope")


@dataclass(frozen=True)
class QuestionSpec:
    """One question; optional fields resolved to real values."""

    key: str
    prompt: str
    options: tuple[str, ...] = ()
    multiple: bool = False
    allow_other: bool = False

    def to_json(self) -> dict[str, Any]:
        """The stored form."""
        return {
            "key": self.key,
            "prompt": self.prompt,
            "options": list(self.options),
            "multiple": self.multiple,
            "allow_other": self.allow_other,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> QuestionSpec:
        """From the stored form."""
        return cls(
            data["key"],
            data["prompt"],
            tuple(data.get("options", ())),
            bool(data.get("multiple", False)),
            bool(data.get("allow_other", False)),
        )


@dataclass(frozen=True)
class RunFacts:
    """What interactions may know of a run, as the orchestrator (its one authority) tells it:
    whose it is, its conversation, the interaction it is parked on, and whether the lease asked
    about is live (the orchestrator's lease fence decides; interactions never restates it)."""

    tenant_id: str
    session_id: str
    # The principal whose key admitted it; None when unknown (it then owns no grant or account).
    owner_principal_id: str | None
    status: RunStatus
    waiting_interaction_id: str
    # Whether the run is running under the lease epoch the lookup asked about (False when it
    # asked about none).
    lease_held: bool
    # The approval policy of the agent version the run is pinned to (JSON text), told for a
    # lease lookup only; "" for none, and then the tenant's policy decides.
    approval_policy: str = ""
    # The secrets the agent version the run is pinned to names (its MCP servers' bearers), told
    # for a lease lookup only: the only ones its lease holder may read.
    secret_names: tuple[str, ...] = ()

    def parked_on(self, kind: str, interaction_id: str) -> bool:
        """Whether the run waits on exactly this interaction, of this kind."""
        return self.status == WAITING_FOR[kind] and self.waiting_interaction_id == interaction_id

    def bound(self, kind: str) -> str | None:
        """The interaction of `kind` the run is parked on, if it is parked on one."""
        if self.status != WAITING_FOR[kind] or not self.waiting_interaction_id:
            return None
        return self.waiting_interaction_id


class Orchestrator(Protocol):
    """The orchestrator, as far as interactions need it: the one authority over runs."""

    async def visible_run(
        self, viewer: Viewer, run_id: str, *, held_epoch: int | None = None
    ) -> RunFacts:
        """The run, if the viewer may see it; NotFound for absent, another tenant's and another
        principal's alike. With `held_epoch`, its `lease_held` says whether that lease is
        live."""

    async def leased_run(self, run_id: str, epoch: int) -> RunFacts:
        """The run, if `epoch` is its live lease; StaleLease otherwise (fail closed)."""

    async def resume(
        self,
        tenant_id: str,
        run_id: str,
        from_status: str,
        event: Event,
        interaction_id: str,
    ) -> bool:
        """Queue a run parked on `interaction_id` once; False when it had already moved or
        waits on another one."""

    async def expire(
        self,
        tenant_id: str,
        run_id: str,
        from_status: str,
        error: RunError,
        event: Event,
        interaction_id: str,
    ) -> bool:
        """Fail a run whose pause on `interaction_id` expired; False when it had already moved
        or waits on another one."""


class TokenExchange(Protocol):
    """The OAuth provider's token endpoint."""

    async def exchange(self, provider: str, code: str) -> tuple[str, float, list[str]]:
        """(access token, lifetime in seconds, granted scopes) for an authorisation code."""


@dataclass(frozen=True)
class OAuthProvider:
    """How to send a person to a provider's consent screen."""

    name: str
    authorize_url: str
    client_id: str
    redirect_uri: str


@dataclass
class Policy:
    """Interaction settings (per deployment; tenants refine some in their policy JSON)."""

    approval_ttl_s: float = 86_400.0
    consent_ttl_s: float = 900.0
    providers: dict[str, OAuthProvider] = field(default_factory=dict)
    orphan_grace_s: float = 10.0


WAITING_FOR = {
    "question": RunStatus.WAITING_FOR_QUESTION.value,
    "approval": RunStatus.WAITING_FOR_APPROVAL.value,
    "connection": RunStatus.WAITING_FOR_CONNECTION.value,
}

# What each kind of resolution resumes from, and the event that records it (once, with the
# run.queued that follows).
RESOLUTIONS: dict[str, Callable[[str, str], tuple[str, Event]]] = {
    "question": lambda i, _: (
        "waiting-for-question",
        interaction_event(EventType.QUESTION_ANSWERED, i),
    ),
    "approval": lambda i, decision: (
        "waiting-for-approval",
        interaction_event(EventType.APPROVAL_DECIDED, i, decision=decision),
    ),
    "connection": lambda i, _: (
        "waiting-for-connection",
        interaction_event(EventType.CONNECTION_COMPLETED, i, outcome="connected"),
    ),
}


def validate_specs(specs: Sequence[QuestionSpec]) -> None:
    """Refuse a malformed question before anyone is asked it."""
    if not specs:
        raise InvalidArgument("at least one question is required")
    keys = [s.key for s in specs]
    if len(set(keys)) != len(keys):
        raise InvalidArgument("question keys must be unique")
    for spec in specs:
        if not spec.key or not spec.prompt.strip():
            raise InvalidArgument("every question needs a key and a prompt")
        if spec.multiple and not spec.options:
            raise InvalidArgument(f"question {spec.key!r}: multiple needs options")


def validate_answers(
    specs: Sequence[QuestionSpec], answers: Mapping[str, Sequence[str]]
) -> dict[str, list[str]]:
    """Answers checked against their specs; INVALID_ARGUMENT naming the first problem."""
    by_key = {s.key: s for s in specs}
    unknown = sorted(set(answers) - set(by_key))
    if unknown:
        raise InvalidArgument(f"no question has the key(s) {unknown}; keys are {list(by_key)}")
    out: dict[str, list[str]] = {}
    for spec in specs:
        values = [v for v in answers.get(spec.key, ()) if v.strip()]
        if not values:
            raise InvalidArgument(f"question {spec.key!r} ({spec.prompt}) needs an answer")
        if len(values) > 1 and not spec.multiple:
            raise InvalidArgument(f"question {spec.key!r} takes one answer, got {len(values)}")
        if spec.options and not spec.allow_other:
            offered = set(spec.options)
            bad = [v for v in values if v not in offered]
            if bad:
                raise InvalidArgument(
                    f"question {spec.key!r}: {bad[0]!r} is not one of the options "
                    f"{list(spec.options)}"
                )
        out[spec.key] = values
    return out
