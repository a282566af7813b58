"""The approval gate and the connection pause in front of the call path: what every tool call
goes through, in the worker and in the test kit alike.

`ToolCalls.call` takes one call the model made:

1. a tool the agent lacks is refused before the gate (nobody is asked to approve it);
2. a tool in a gated risk category runs under a standing grant (`Approvals.check_grant`), or, when
   its input passes the schema, becomes a pending approval with its normalised input and the call
   ends `Paused("approval")`; an input that fails is refused by the path with the schema's words;
3. `tether.tools.path.execute` runs it (validation, effects record, timeout, inline cap);
4. a `ConnectionGap` the tool raised ends `Paused("connection")` when a consent offer was made
   (`Consent.offer_connection`), or an error result with `ends_run` when none could be.

`ToolCalls.resume` finishes a call a pause left open: a gated call runs what a person approved
(the stored input, once) or is refused as denied/expired/unclaimed; any other call runs again.

The parts that talk to services are the ports: `EffectsPort` (the effects record), `Approvals`
(the approval decision) and `Consent` (the connection offer), plus the `ConnectionResolver` on the
call's context. The worker implements them over gRPC; `tether.testing.tools` in memory.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from tether.tools.base import GATED_RISKS, Authorization, CallContext, ConnectionGap
from tether.tools.effects import EffectsPort, idempotency_key
from tether.tools.path import Catalog, ToolErrorCode, ToolResult, execute, refusal

# What a person decided that does not let the call run.
REFUSED_DECISIONS = {"deny": "denied", "expired": "expired before anyone decided"}


@dataclass(frozen=True)
class ApprovalRequest:
    """A gated call waiting for a person: exactly what they are shown and what will run."""

    tool_call_id: str
    tool_name: str
    input: dict[str, Any]  # normalised: what runs on allow-once is this, not a regenerated call
    risk: str
    summary: str
    idempotency_key: str


@dataclass(frozen=True)
class Decision:
    """A decided approval, claimed for one call: `decision` is "deny", "expired" or an allow;
    `input` is the stored input the person saw."""

    interaction_id: str
    decision: str
    tool_name: str
    input: Mapping[str, Any]


class Approvals(Protocol):
    """The approval decision, as the gate asks for it."""

    async def check_grant(self, tool_name: str, risk: str) -> str | None:
        """The id of a standing grant covering `tool_name` at `risk` for this run, or None."""
        ...

    async def request_approval(self, request: ApprovalRequest) -> str:
        """Store a pending approval; returns the id of the interaction that waits for it."""
        ...

    async def claim(self, tool_name: str, tool_call_id: str) -> Decision | None:
        """Claim the decided approval of this call (once), or None when there is none."""
        ...


class Consent(Protocol):
    """The connection flow: an offer a person can act on, for a gap a tool met."""

    async def offer_connection(self, tool_call_id: str, gap: ConnectionGap) -> str | None:
        """The id of the interaction that waits for the person to connect, or None when no
        offer can be made."""
        ...


@dataclass(frozen=True)
class Paused:
    """The call cannot finish now: the run waits for a person (`interaction_id`)."""

    reason: Literal["approval", "connection"]
    interaction_id: str
    tool_name: str
    provider: str = ""

    def __str__(self) -> str:
        if self.reason == "connection":
            return f"paused for connection {self.provider}"
        return f"paused for approval of {self.tool_name}"


@dataclass
class ToolCalls:
    """The calls of one run (one attempt): the catalog, the ports and the run's limits.

    `before_fire` is awaited before a tool that writes externally runs (the worker makes the
    call durable there); `running` wraps the path's run of a tool (the worker announces a slow
    one). Both are optional.
    """

    catalog: Catalog
    effects: EffectsPort
    allowlist: Collection[str]
    max_inline_bytes: int
    approvals: Approvals | None = None
    consent: Consent | None = None
    before_fire: Callable[[], Awaitable[None]] | None = None
    running: Callable[[Coroutine[Any, Any, ToolResult]], Awaitable[ToolResult]] | None = None

    async def call(
        self, call: CallContext, name: str, input: dict[str, Any], *, output_ref: str
    ) -> ToolResult | Paused:
        """One call the model made (see the module docstring). Raises CancelledError when
        cancelled, and what the ports raise."""
        if name not in self.allowlist:
            return refusal(ToolErrorCode.NOT_ALLOWED, f"tool {name} is not available to this agent")
        gated = await self._gate(call, name, input)
        if isinstance(gated, Paused):
            return gated
        return await self.fire(call, name, input, gated, output_ref=output_ref)

    async def resume(
        self, call: CallContext, name: str, input: dict[str, Any], *, output_ref: str
    ) -> ToolResult | Paused:
        """Finish a call a pause left open: a gated call runs its claimed approval's stored
        input (or is refused, failing closed); any other runs again."""
        prepared = self.catalog.prepared(name)
        if prepared is None or prepared.spec.risk not in GATED_RISKS:
            return await self.fire(call, name, input, None, output_ref=output_ref)
        claim = (
            None if self.approvals is None else await self.approvals.claim(name, call.tool_call_id)
        )
        if claim is None:
            return refusal("approval_unclaimed", f"approval for {name} could not be claimed")
        verdict = REFUSED_DECISIONS.get(claim.decision)
        if verdict is not None:
            return refusal(
                f"approval_{claim.decision}",
                f"the approval for {name} was {verdict}; it did not run",
            )
        authorization = Authorization(
            "approval", claim.interaction_id, claim.tool_name, call.run_id
        )
        return await self.fire(
            call, claim.tool_name, dict(claim.input), authorization, output_ref=output_ref
        )

    async def fire(
        self,
        call: CallContext,
        name: str,
        input: dict[str, Any],
        authorization: Authorization | None,
        *,
        output_ref: str,
    ) -> ToolResult | Paused:
        """Run the call through the path (after the gate), a connection gap ending in a pause
        or in a result that ends the run."""
        prepared = self.catalog.prepared(name)
        if prepared is not None and prepared.spec.writes_externally and self.before_fire:
            await self.before_fire()  # the call is durable before its side effect can fire
        work = execute(
            self.catalog,
            name,
            input,
            call,
            effects=self.effects,
            allowlist=self.allowlist,
            max_inline_bytes=self.max_inline_bytes,
            output_ref=output_ref,
            authorization=authorization,
        )
        try:
            return await (work if self.running is None else self.running(work))
        except ConnectionGap as gap:
            return await self._gap(call, name, gap)

    async def _gate(
        self, call: CallContext, name: str, input: dict[str, Any]
    ) -> Authorization | Paused | None:
        """A standing grant authorises a gated call; otherwise the call becomes a pending
        approval with its normalised input. None: ungated, unknown (the path refuses it), no
        approvals wired (the path refuses it: fail closed) or an input that cannot succeed."""
        prepared = self.catalog.prepared(name)
        if prepared is None or prepared.spec.risk not in GATED_RISKS or self.approvals is None:
            return None
        risk = str(prepared.spec.risk)
        grant = await self.approvals.check_grant(name, risk)
        if grant is not None:
            return Authorization("grant", grant, name, call.run_id)
        normalised, problem = prepared.check(input)
        if problem:
            return None  # nobody is asked to authorise a call that cannot succeed
        interaction_id = await self.approvals.request_approval(
            ApprovalRequest(
                tool_call_id=call.tool_call_id,
                tool_name=name,
                input=normalised,
                risk=risk,
                summary=summary(name, normalised),
                idempotency_key=idempotency_key(call.tenant_id, call.run_id, name, normalised),
            )
        )
        return Paused("approval", interaction_id, name)

    async def _gap(self, call: CallContext, name: str, gap: ConnectionGap) -> ToolResult | Paused:
        """Pause for consent only when all three hold: a marked gap, a consent flow wired, and
        an offer it made (the provider has a login URL). Otherwise the run fails: failing is
        recoverable, hanging on a screen nobody can reach is not."""
        offer = None
        if self.consent is not None and "oauth" in gap.login_modes:
            offer = await self.consent.offer_connection(call.tool_call_id, gap)
        if offer is None:
            return refusal(f"connection_{gap.gap}", str(gap), ends_run=True)
        return Paused("connection", offer, name, gap.provider)


def summary(name: str, input: dict[str, Any]) -> str:
    """The one line a person reads when asked to approve a call."""
    shown = ", ".join(f"{k}={str(v)[:80]!r}" for k, v in sorted(input.items()))
    return f"Run {name}({shown})"
