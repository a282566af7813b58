"""What a tool is: its spec (what the model sees), its context, its output, and how it fails.

A tool is any object with a `spec` and an async `run` (`Tool`); `@tool` makes one from a function
(`tether.tools.decorator`), and a `ToolDefinition` from any spec and async callable (a tool source
such as an MCP server). Tools arrive through `ToolProvider`s registered under the `tether.tools`
entry-point group, so a deployment adds tools by installing a package, not by editing the worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable


class RiskCategory(StrEnum):
    """The policy class of a tool's action; every category but READ needs approval by policy."""

    READ = "read"
    PUBLISH = "publish"
    SCHEDULE = "schedule"
    SEND_REPLY = "send_reply"
    DELETE = "delete"
    EXTERNAL_SHARE = "external_share"
    PAID_MARKETING = "paid_marketing"
    INTERACTION = "interaction"


@dataclass(frozen=True)
class ToolSpec:
    """A tool's contract.

    `input_schema` is the JSON Schema the model is shown and the input is validated against
    before the tool runs (`tether.tools.schema`, draft 2020-12). `writes_externally`
    puts every call behind the effects record and an idempotency key.
    """

    name: str
    description: str
    input_schema: dict[str, Any]
    risk: RiskCategory = RiskCategory.READ
    timeout_s: float = 30.0
    writes_externally: bool = False

    def to_anthropic(self) -> dict[str, Any]:
        """The Messages API tool parameter: `{"name", "description", "input_schema"}`."""
        return {
            "name": self.name,
            "description": self.description,
            "input_schema": self.input_schema,
        }


@dataclass(frozen=True)
class CallContext:
    """Who is calling: the identity of one tool call, before the registry derives its key."""

    tenant_id: str
    run_id: str
    root_run_id: str
    tool_call_id: str
    connections: ConnectionResolver | None = None

    def with_key(self, idempotency_key: str | None) -> ToolContext:
        """The context a tool receives, carrying the key the registry derived (or None)."""
        return ToolContext(
            tenant_id=self.tenant_id,
            run_id=self.run_id,
            root_run_id=self.root_run_id,
            tool_call_id=self.tool_call_id,
            idempotency_key=idempotency_key,
            connections=self.connections,
        )


@dataclass(frozen=True)
class ToolContext:
    """What a running tool knows about its call.

    - `tenant_id`, `run_id`, `root_run_id` (the first run of a resumed lineage), `tool_call_id`:
      who is calling; for logs and for the external system's own records.
    - `idempotency_key`: set for tools that write externally, None otherwise. Such a tool must
      pass it to the external system (a header, a request id), which is what makes a re-fired
      call harmless: after a crash between firing and recording, the call fires again with the
      same key.
    - `connections`: the run principal's credentials (`await ctx.connections.token(provider,
      scopes)`), which raises `ConnectionGap` when there is none usable; None where no resolver
      is wired.
    - `cancelled`: set when the call is cancelled (the run was cancelled, its lease lost, the
      worker is stopping). The task running the tool is cancelled too, so an `await` inside the
      tool raises CancelledError; a tool doing work between awaits (a thread, a subprocess, a
      loop without awaits) checks `ctx.cancelled.is_set()` or waits on it, and stops.
    """

    tenant_id: str
    run_id: str
    root_run_id: str
    tool_call_id: str
    idempotency_key: str | None
    connections: ConnectionResolver | None = None
    cancelled: asyncio.Event = field(default_factory=asyncio.Event, compare=False, repr=False)


class ConnectionResolver(Protocol):
    """Gives a tool the run principal's credential for a provider, or raises ConnectionGap."""

    async def token(self, provider: str, scopes: Sequence[str]) -> str:
        """An access token with `scopes`; ConnectionGap when there is none usable."""


@dataclass(frozen=True)
class ToolOutput:
    """What a tool returns: text for the model, whether it is an error, optional structure."""

    content: str
    is_error: bool = False
    data: dict[str, Any] | None = None


class ToolError(Exception):
    """An expected failure: the message becomes an error result the model can act on.

    Word it for the model: what went wrong and what would work (`"no order 1234; order ids look
    like ORD-1234"`). The message is shown as the call's result with the code `tool_error`; the
    run goes on. Any other exception is a crash: the model sees only `tool <name> failed
    unexpectedly (<ExceptionType>)`, and the traceback goes to the operator's log.

    For a tool that writes externally, a ToolError is an outcome like any other: it is recorded
    as the call's result and replayed, so raise it only when the external system gave a definite
    answer (refused, not found). When the outcome is unknown (connection lost mid-request), raise
    anything else, so the record stays open and a retry fires again under the same key.
    """


class UnsettledCall(Exception):
    """A failure the model reads (`str(exc)`, with the stable `code`) that the effects record
    must NOT keep: the call did not run (the remote end was down, refused the credential), or
    whether it ran cannot be known (a timeout, a connection lost after the request left).

    Unlike a `ToolError` it is not recorded, so the record stays open: a retry of the same call
    (after a worker's death, or the model calling it again) fires again under the same
    idempotency key, which the external system deduplicates. The run goes on."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


@runtime_checkable
class Tool(Protocol):
    """One tool: a spec and an async `run`. Cancellation of `run` must stop the work."""

    @property
    def spec(self) -> ToolSpec:
        """The tool's contract."""
        ...

    async def run(self, ctx: ToolContext, input: dict[str, Any]) -> ToolOutput:
        """Do the work for an input already validated against `spec.input_schema`."""
        ...


@runtime_checkable
class ToolProvider(Protocol):
    """A source of tools; the object an entry point in the `tether.tools` group names."""

    def tools(self, settings: Mapping[str, str]) -> Sequence[Tool]:
        """Build the tools; `settings` is env-like configuration: the worker's `TETHER_TOOL_...`
        settings only (e.g. `TETHER_TOOL_LEDGER_URL`)."""
        ...


# Policy-classified actions: a call in one of these runs only with an approval or a grant.
GATED_RISKS = frozenset(
    {
        RiskCategory.PUBLISH,
        RiskCategory.SCHEDULE,
        RiskCategory.SEND_REPLY,
        RiskCategory.DELETE,
        RiskCategory.EXTERNAL_SHARE,
        RiskCategory.PAID_MARKETING,
    }
)


@dataclass(frozen=True)
class Authorization:
    """What lets a gated call run: a standing grant, or a claimed approval, for one tool of one
    run."""

    kind: str  # "grant" | "approval"
    ref: str
    tool_name: str
    run_id: str


class ConnectionGap(ToolError):
    """A tool lacks a usable connection: `ctx.connections.token` raises it, and a tool may raise
    it itself (`gap` is "absent", "expired" or "insufficient_scope").

    It is not an error result: the call path lets it through, and the run pauses
    `waiting-for-connection` with a consent offer (a login URL) for the person the run acts for;
    once they connect, the call runs again. When no offer can be made (no consent flow, or the
    provider has no login URL: `login_modes` without "oauth") the run fails with
    `connection_<gap>`. The marker is structural (`gap`, `provider`), so rewording a message
    never turns a pausable failure into a fatal one or back."""

    def __init__(
        self,
        *,
        provider: str,
        gap: str,
        scopes: Sequence[str],
        credential_ref: str,
        login_modes: Sequence[str] = ("oauth",),
    ) -> None:
        self.provider = provider
        self.gap = gap
        self.scopes = tuple(scopes)
        self.credential_ref = credential_ref
        # How the toolkit authenticates: only "oauth" has a login URL to send a person to.
        self.login_modes = tuple(login_modes)
        super().__init__(
            GAP_MESSAGES[gap].format(
                provider=provider, ref=credential_ref, scopes=", ".join(scopes)
            )
        )


# Three gaps, three sentences: a person told the wrong one looks in the wrong place.
GAP_MESSAGES = {
    "absent": "no {provider} connection exists ({ref}); connect your {provider} account",
    "expired": "the {provider} connection expired ({ref}); sign in to {provider} again",
    "insufficient_scope": "the {provider} connection ({ref}) lacks the scope(s) {scopes}; "
    "grant them when reconnecting",
}
