"""Run a tool through the path production runs it on, without a stack: `ToolKit`.

    kit = ToolKit(create_ticket, approval="allow-once")
    first = await kit.call({"title": "printer on fire"})
    again = await kit.call({"title": "printer on fire"})
    assert again.replayed and again.fired == 0   # same idempotency key: the record replays

The call goes through `tether.tools.calls.ToolCalls` and `tether.tools.path.execute`, the same
code the worker runs: the input is checked against the tool's schema (a bad input never reaches
the tool), a gated tool needs the chosen decision, a tool that writes externally goes through an
in-memory effects record under its idempotency key, a missing connection pauses the call, and
`cancel=True` cancels the call while the tool runs. What differs is only what is behind the ports:
memory instead of the orchestrator and the interactions service.

Choices (constructor arguments):

- `approval`: what a person decides for a gated tool: None (nobody has yet: the call reports
  "paused for approval of <tool>"), "allow-once" (the stored input runs once), "deny", "expired",
  or "grant" (a standing grant: no approval is asked for).
- `connections`: provider -> access token `ctx.connections.token` answers with; a provider not
  listed is an absent connection, and `gaps` (provider -> "expired" | "insufficient_scope")
  names other gaps. A gap pauses the call ("paused for connection <provider>"), or, with
  `consent=False` (no consent flow, as a run nobody can act for), ends the run.
- `effects`: the record, shared between kits to share effects (default: one per kit).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tether.domain import EffectState
from tether.tools.base import CallContext, ConnectionGap, Tool, ToolContext, ToolOutput, ToolSpec
from tether.tools.calls import ApprovalRequest, Decision, Paused, ToolCalls
from tether.tools.path import PreparedTool, ToolResult

ApprovalChoice = Literal["allow-once", "deny", "expired", "grant"]
# How long `cancel=True` waits for the tool to start before it gives up on the test.
START_DEADLINE_S = 10.0


class MemoryEffects:
    """The effects record in memory, with the orchestrator's contract: the first `begin` of a
    key answers BEGUN, later ones IN_PROGRESS until `finish`, then DONE with the result."""

    def __init__(self) -> None:
        self._records: dict[str, tuple[EffectState, dict[str, Any] | None]] = {}

    async def begin(self, key: str, tool_name: str) -> tuple[EffectState, dict[str, Any] | None]:
        """Begin the effect named `key` (see the class docstring)."""
        record = self._records.get(key)
        if record is None:
            self._records[key] = (EffectState.IN_PROGRESS, None)
            return EffectState.BEGUN, None
        return record

    async def finish(self, key: str, result: dict[str, Any]) -> None:
        """Record the result of `key`."""
        self._records[key] = (EffectState.DONE, dict(result))

    def state(self, key: str) -> EffectState | None:
        """Where the effect `key` stands: IN_PROGRESS (begun, never finished: a retry fires
        again under the key), DONE, or None (never begun)."""
        record = self._records.get(key)
        return None if record is None else record[0]


@dataclass
class _Desk:
    """The approval decision and the consent offer, as the kit's choices make them."""

    approval: ApprovalChoice | None
    consent: bool
    requests: list[ApprovalRequest] = field(default_factory=list)
    offers: list[ConnectionGap] = field(default_factory=list)

    async def check_grant(self, tool_name: str, risk: str) -> str | None:
        return "grt_kit" if self.approval == "grant" else None

    async def request_approval(self, request: ApprovalRequest) -> str:
        self.requests.append(request)
        return f"int_approval_{len(self.requests)}"

    async def claim(self, tool_name: str, tool_call_id: str) -> Decision | None:
        asked = [r for r in self.requests if r.tool_call_id == tool_call_id]
        if not asked or self.approval in (None, "grant"):
            return None
        request = asked[-1]
        return Decision(
            f"int_approval_{len(self.requests)}", self.approval, tool_name, request.input
        )

    async def offer_connection(self, tool_call_id: str, gap: ConnectionGap) -> str | None:
        if not self.consent:
            return None
        self.offers.append(gap)
        return f"int_connection_{len(self.offers)}"


@dataclass
class MemoryConnections:
    """A `ConnectionResolver`: tokens by provider; anything else is a gap."""

    tokens: Mapping[str, str]
    gaps: Mapping[str, str]

    async def token(self, provider: str, scopes: Sequence[str]) -> str:
        """The provider's token, or ConnectionGap (absent unless `gaps` names another)."""
        gap = self.gaps.get(provider) or ("absent" if provider not in self.tokens else None)
        if gap is not None:
            raise ConnectionGap(
                provider=provider, gap=gap, scopes=scopes, credential_ref=f"conn_kit_{provider}"
            )
        return self.tokens[provider]


@dataclass(frozen=True)
class Outcome:
    """What came of one call.

    `content`/`is_error`/`error_code`/`data`/`replayed`/`idempotency_key` are the result the
    model would read (see `tether.tools.path.ToolResult`); `paused` says why the run would wait
    ("paused for approval of <tool>", "paused for connection <provider>") and is None otherwise;
    `approval` is what a person was asked to approve; `fired` counts the times the tool's `run`
    was entered; `cancelled` means the call was cancelled while the tool ran, and `saw_cancel`
    that the tool's `ctx.cancelled` was set; `ends_run` that the run could not go on.
    """

    content: str = ""
    is_error: bool = False
    error_code: str | None = None
    data: dict[str, Any] | None = None
    replayed: bool = False
    idempotency_key: str | None = None
    truncated: bool = False
    ends_run: bool = False
    paused: str | None = None
    approval: ApprovalRequest | None = None
    fired: int = 0
    cancelled: bool = False
    saw_cancel: bool = False


class _Watched:
    """The tool, watched: each entry into `run` is counted and its context kept."""

    def __init__(self, tool: Tool) -> None:
        self._tool = tool
        self.spec: ToolSpec = tool.spec
        self.entered = asyncio.Event()
        self.runs = 0
        self.contexts: list[ToolContext] = []

    async def run(self, ctx: ToolContext, input: dict[str, Any]) -> ToolOutput:
        self.runs += 1
        self.contexts.append(ctx)
        self.entered.set()
        return await self._tool.run(ctx, input)


class _OneTool:
    def __init__(self, prepared: PreparedTool) -> None:
        self._prepared = prepared

    def prepared(self, name: str) -> PreparedTool | None:
        return self._prepared if name == self._prepared.spec.name else None


class ToolKit:
    """One tool and the choices its calls meet (see the module docstring)."""

    def __init__(
        self,
        tool: Tool,
        *,
        approval: ApprovalChoice | None = None,
        connections: Mapping[str, str] | None = None,
        gaps: Mapping[str, str] | None = None,
        consent: bool = True,
        effects: MemoryEffects | None = None,
        tenant_id: str = "ten_kit",
        run_id: str = "run_kit",
        max_inline_bytes: int = 16_384,
    ) -> None:
        self._watched = _Watched(tool)
        self.effects = effects if effects is not None else MemoryEffects()
        self.desk = _Desk(approval, consent)
        self.connections = MemoryConnections(dict(connections or {}), dict(gaps or {}))
        self._tenant_id, self._run_id = tenant_id, run_id
        self._calls = ToolCalls(
            catalog=_OneTool(PreparedTool(self._watched)),
            effects=self.effects,
            allowlist=[tool.spec.name],
            max_inline_bytes=max_inline_bytes,
            approvals=self.desk,
            consent=self.desk,
        )
        self._ids = itertools.count(1)

    async def call(self, input: dict[str, Any], *, cancel: bool = False) -> Outcome:
        """Call the tool with `input` as the model would; `cancel` cancels the call as soon as
        the tool's `run` is entered (its first `await` raises CancelledError)."""
        call = CallContext(
            tenant_id=self._tenant_id,
            run_id=self._run_id,
            root_run_id=self._run_id,
            tool_call_id=f"toolu_kit_{next(self._ids)}",
            connections=self.connections,
        )
        runs_before, asked_before = self._watched.runs, len(self.desk.requests)
        self._watched.entered.clear()
        task = asyncio.ensure_future(self._through(call, input))
        if not cancel:
            result = await task
            return self._outcome(result, runs_before, asked_before)
        entered = asyncio.ensure_future(self._watched.entered.wait())
        try:
            await asyncio.wait(
                {task, entered}, timeout=START_DEADLINE_S, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            entered.cancel()
        if task.done():
            return self._outcome(task.result(), runs_before, asked_before)
        task.cancel()
        try:
            result = await task
        except asyncio.CancelledError:
            context = self._watched.contexts[-1] if self._watched.runs > runs_before else None
            return Outcome(
                fired=self._watched.runs - runs_before,
                cancelled=True,
                saw_cancel=context is not None and context.cancelled.is_set(),
                idempotency_key=context.idempotency_key if context else None,
            )
        return self._outcome(result, runs_before, asked_before)

    async def _through(self, call: CallContext, input: dict[str, Any]) -> ToolResult | Paused:
        name = self._watched.spec.name
        outcome = await self._calls.call(call, name, input, output_ref=f"out_{call.tool_call_id}")
        if isinstance(outcome, Paused) and outcome.reason == "approval" and self.desk.approval:
            # A person decided: the run resumes and the call is finished as production does.
            return await self._calls.resume(
                call, name, input, output_ref=f"out_{call.tool_call_id}"
            )
        return outcome

    def _outcome(self, result: ToolResult | Paused, runs_before: int, asked_before: int) -> Outcome:
        asked = self.desk.requests[asked_before:]
        approval = asked[-1] if asked else None
        fired = self._watched.runs - runs_before
        if isinstance(result, Paused):
            return Outcome(paused=str(result), approval=approval, fired=fired)
        return Outcome(
            content=result.content,
            is_error=result.is_error,
            error_code=result.error_code,
            data=result.data,
            replayed=result.replayed,
            idempotency_key=result.idempotency_key,
            truncated=result.truncated,
            ends_run=result.ends_run,
            approval=approval,
            fired=fired,
        )
