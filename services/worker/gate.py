"""The gate a tool call passes: questions, approvals, connections, and the calls a pause left open.

A call is refused before the gate when the agent lacks the tool; a gated call runs under a
standing grant or parks the run for approval; a question parks it until answered; a missing
connection parks it for consent, or fails the run when nobody could consent. On resume the
open calls are finished first: answers delivered, claimed approvals run with their stored input.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from services.worker import observed
from services.worker.checkpoints import CheckpointWriter
from services.worker.interactions import (
    ASK_QUESTIONS,
    REQUEST_APPROVAL,
    LeasedInteractions,
    Parked,
    answers_text,
)
from services.worker.orchestrator_client import LeasedEffects, Orchestrator
from services.worker.tools.base import GATED_RISKS, Authorization, CallContext, ConnectionGap
from services.worker.tools.effects import idempotency_key
from services.worker.tools.registry import ToolErrorCode, ToolRegistry
from services.worker.transcript import Transcript
from tether import telemetry
from tether.domain import (
    ApprovalMarker,
    Assignment,
    ConnectionMarker,
    QuestionMarker,
    Role,
    RunError,
    ToolCall,
    ToolResult,
    tool_completed,
    tool_failed,
)
from tether.errors import InvalidArgument
from tether.ids import new_id
from tether.states import RunStatus

T = TypeVar("T")
# A tool that returns within this is announced in the same checkpoint as its result.
ANNOUNCE_AFTER_S = 0.05


class RunFailed(Exception):
    """A classified failure that ends the run (e.g. a connection gap with no way to consent)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Gate:
    """Runs one attempt's tool calls through approvals, questions and connections."""

    def __init__(
        self,
        assignment: Assignment,
        *,
        orchestrator: Orchestrator,
        registry: ToolRegistry,
        interactions: LeasedInteractions | None,
        transcript: Transcript,
        checkpoints: CheckpointWriter,
    ) -> None:
        self._assignment = assignment
        self._run_id = assignment.run_id
        self._config = assignment.config
        self._orchestrator = orchestrator
        self._registry = registry
        self._interactions = interactions
        self._transcript = transcript
        self._checkpoints = checkpoints

    async def run(self, tool_call: ToolCall) -> None:
        """Run one call the model made, or give it its (error) result, or park the run."""
        if telemetry.on:
            with observed.tool_call(tool_call):
                await self._run(tool_call)
        else:
            await self._run(tool_call)

    async def _run(self, tool_call: ToolCall) -> None:
        name, input = tool_call.name, dict(tool_call.input)
        if name == ASK_QUESTIONS and name in self._config.tool_allowlist:
            await self._ask(tool_call.tool_call_id, input)
            return  # it parked, or it gave the call its one (error) result
        if name == REQUEST_APPROVAL and name in self._config.tool_allowlist:
            name, input = str(input.get("tool_name", "")), dict(input.get("input") or {})
        if name not in self._config.tool_allowlist:
            # Refused before the gate: nobody is asked to approve a tool this agent lacks.
            self._result(
                tool_call.tool_call_id,
                name,
                f"tool {name} is not available to this agent",
                is_error=True,
                code=ToolErrorCode.NOT_ALLOWED,
            )
            return
        authorization = await self._gate(tool_call.tool_call_id, name, input)
        await self._execute(tool_call.tool_call_id, name, input, authorization)

    async def _ask(self, tool_call_id: str, input: dict[str, Any]) -> None:
        """Store the questions and park (never returns normally)."""
        questions = input.get("questions")
        if self._interactions is None or not isinstance(questions, list) or not questions:
            self._result(
                tool_call_id,
                ASK_QUESTIONS,
                "ask_questions needs a list of questions",
                is_error=True,
                code="tool_invalid_input",
            )
            return
        try:
            interaction_id = await self._interactions.ask(tool_call_id, questions)
        except InvalidArgument as exc:
            self._result(
                tool_call_id, ASK_QUESTIONS, exc.message, is_error=True, code="tool_invalid_input"
            )
            return
        self._transcript.add(Role.ASSISTANT, QuestionMarker(interaction_id))
        raise Parked(RunStatus.WAITING_FOR_QUESTION, interaction_id)

    async def _gate(
        self, tool_call_id: str, name: str, input: dict[str, Any]
    ) -> Authorization | None:
        """The approval gate: a standing grant authorises a gated call; otherwise the call
        becomes a pending approval with its normalised input and the run parks."""
        tool = self._registry.get(name)
        if tool is None or tool.spec.risk not in GATED_RISKS or self._interactions is None:
            return None  # ungated, unknown (the registry refuses it) or no store: fail closed
        risk = str(tool.spec.risk)
        grant = await self._interactions.check_grant(name, risk)
        if grant is not None:
            return Authorization("grant", grant, name, self._run_id)
        normalised, problem = self._registry.validate_input(name, input)
        if problem:
            return None  # nobody is asked to authorise a call that cannot succeed
        interaction_id = await self._interactions.request_approval(
            tool_call_id=tool_call_id,
            tool_name=name,
            input=normalised,
            risk=risk,
            summary=_summary(name, normalised),
            policy=self._assignment.config.approvals,
            idempotency_key=idempotency_key(
                self._assignment.tenant_id, self._run_id, name, normalised
            ),
        )
        self._transcript.add(Role.ASSISTANT, ApprovalMarker(interaction_id, name))
        raise Parked(RunStatus.WAITING_FOR_APPROVAL, interaction_id)

    async def _execute(
        self,
        tool_call_id: str,
        name: str,
        input: dict[str, Any],
        authorization: Authorization | None,
    ) -> None:
        output_ref = new_id("out")
        tool = self._registry.get(name)
        if tool is not None and tool.spec.writes_externally:
            await self._checkpoints.sync()  # the call is durable before its side effect can fire
        try:
            result = await self._while_announced(
                self._registry.execute(
                    name,
                    input,
                    CallContext(
                        tenant_id=self._assignment.tenant_id,
                        run_id=self._run_id,
                        root_run_id=self._assignment.root_run_id,
                        tool_call_id=tool_call_id,
                        connections=self._interactions,
                    ),
                    effects=LeasedEffects(self._orchestrator, self._assignment.lease),
                    allowlist=list(self._config.tool_allowlist),
                    max_inline_bytes=self._config.limits.max_inline_tool_output_bytes or 16_384,
                    output_ref=output_ref,
                    authorization=authorization,
                )
            )
        except ConnectionGap as gap:
            await self._connection_gap(tool_call_id, gap)
            return
        if result.full_content is not None:
            await self._orchestrator.store_tool_output(
                self._assignment.lease, output_ref, result.full_content
            )
        self._result(
            tool_call_id,
            name,
            result.content,
            is_error=result.is_error,
            code=result.error_code,
            replayed=result.replayed,
            output_ref=output_ref if result.truncated else "",
            truncated=result.truncated,
        )

    async def _while_announced(self, work: Coroutine[Any, Any, T]) -> T:
        """Run a tool; a quick one shares its checkpoint with tool.started, a slower one gets
        tool.started persisted (and streamed) while it runs."""
        task = asyncio.ensure_future(work)
        try:
            done, _ = await asyncio.wait({task}, timeout=ANNOUNCE_AFTER_S)
            if not done:
                self._checkpoints.checkpoint()
            return await task
        except BaseException:
            task.cancel()  # cancellation of the run cancels the tool with it
            raise

    async def _connection_gap(self, tool_call_id: str, gap: ConnectionGap) -> None:
        """Pause for consent only when all three hold: a marked gap, a consent callback wired
        (the interactions service), and an offer it made (the provider has a login URL).
        Otherwise fail: failing is recoverable, hanging on a screen nobody can reach is not."""
        offer = None
        if self._interactions is not None and "oauth" in gap.login_modes:
            offer = await self._interactions.offer_connection(tool_call_id, gap)
        if offer is None:
            self._result(tool_call_id, "", str(gap), is_error=True, code=f"connection_{gap.gap}")
            raise RunFailed(f"connection_{gap.gap}", str(gap))
        self._transcript.add(Role.ASSISTANT, ConnectionMarker(offer.interaction_id, gap.provider))
        raise Parked(RunStatus.WAITING_FOR_CONNECTION, offer.interaction_id)

    def _result(
        self,
        tool_call_id: str,
        name: str,
        content: str,
        *,
        is_error: bool,
        code: str | None = None,
        replayed: bool = False,
        output_ref: str = "",
        truncated: bool = False,
    ) -> None:
        self._transcript.add(
            Role.TOOL, ToolResult(tool_call_id, content, is_error, output_ref, truncated)
        )
        if is_error:
            self._transcript.record(
                tool_failed(tool_call_id, name, RunError(code or "tool_error", content))
            )
        else:
            self._transcript.record(tool_completed(tool_call_id, name, replayed=replayed))

    async def resume_paused(self) -> None:
        """Finish the calls a pause left open: answers become the call's result (a user-role
        line in the history), a claimed approval runs its stored input, a completed consent
        runs the call again."""
        for tool_call in self._transcript.dangling_tool_calls():
            if telemetry.on:
                with observed.tool_call(tool_call):
                    await self._finish_paused(tool_call)
            else:
                await self._finish_paused(tool_call)

    async def _finish_paused(self, tool_call: ToolCall) -> None:
        name, input = tool_call.name, dict(tool_call.input)
        if name == ASK_QUESTIONS:
            await self._deliver_answers(tool_call.tool_call_id)
            return
        if name == REQUEST_APPROVAL:
            name = str(input.get("tool_name", ""))
        tool = self._registry.get(name)
        if tool is not None and tool.spec.risk in GATED_RISKS:
            await self._run_claimed(tool_call.tool_call_id, name)
        else:
            await self._execute(tool_call.tool_call_id, name, input, None)

    async def _deliver_answers(self, tool_call_id: str) -> None:
        answered = [] if self._interactions is None else await self._interactions.answered()
        for question in answered:
            if question.tool_call_id == tool_call_id:
                self._result(tool_call_id, ASK_QUESTIONS, answers_text(question), is_error=False)
                return
        self._result(
            tool_call_id,
            ASK_QUESTIONS,
            "the question was not answered",
            is_error=True,
            code="question_unanswered",
        )

    async def _run_claimed(self, tool_call_id: str, name: str) -> None:
        claim = (
            None
            if self._interactions is None
            else await self._interactions.claim(name, tool_call_id)
        )
        if claim is None:
            # Fail closed: nothing decided could be claimed, so nothing runs.
            self._result(
                tool_call_id,
                name,
                f"approval for {name} could not be claimed",
                is_error=True,
                code="approval_unclaimed",
            )
            return
        if claim.decision in ("deny", "expired"):
            verdict = "denied" if claim.decision == "deny" else "expired before anyone decided"
            self._result(
                tool_call_id,
                name,
                f"the approval for {name} was {verdict}; it did not run",
                is_error=True,
                code=f"approval_{claim.decision}",
            )
            return
        # What runs is what was shown: the stored, normalised input, not a regenerated call.
        await self._execute(
            tool_call_id,
            claim.tool_name,
            dict(claim.input),
            Authorization("approval", claim.interaction_id, claim.tool_name, self._run_id),
        )


def _summary(name: str, input: dict[str, Any]) -> str:
    shown = ", ".join(f"{k}={str(v)[:80]!r}" for k, v in sorted(input.items()))
    return f"Run {name}({shown})"
