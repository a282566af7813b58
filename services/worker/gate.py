"""The gate a tool call passes: questions, approvals, connections, and the calls a pause left open.

A call is refused before the gate when the agent lacks the tool; a gated call runs under a
standing grant or parks the run for approval; a question parks it until answered; a missing
connection parks it for consent, or fails the run when nobody could consent. On resume the
open calls are finished first: answers delivered, claimed approvals run with their stored input.

The approval gate and the connection pause of a tool call are `tether.tools.calls.ToolCalls`, the
one path every call takes (the test kit takes it too); this module implements its ports over the
worker's gRPC clients (`_InteractionsPorts`, `LeasedEffects`) and turns its answers into the
run's transcript: results, markers, parking and failing. The questions (`ask_questions`) and the
`request_approval` wrapper are the worker's own interaction tools and stay here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

from services.worker import observed
from services.worker.checkpoints import CheckpointWriter
from services.worker.delegation import (
    DELEGATE,
    Child,
    DelegateRefused,
    child_result,
    delegate_input,
)
from services.worker.interactions import (
    ASK_QUESTIONS,
    REQUEST_APPROVAL,
    LeasedInteractions,
    Parked,
    answers_text,
)
from services.worker.mcp.tools import LeasedTools
from services.worker.orchestrator_client import LeasedEffects, Orchestrator
from services.worker.timers import WAIT_UNTIL, WaitRefused, due_time, rfc3339, woke_text, woken
from services.worker.tools.registry import ToolRegistry
from services.worker.transcript import Transcript
from tether import telemetry
from tether.domain import (
    DEFAULT_MAX_WAIT_S,
    ApprovalMarker,
    Assignment,
    ConnectionMarker,
    QuestionMarker,
    Role,
    RunError,
    TimerMarker,
    ToolCall,
    ToolResult,
    tool_completed,
    tool_failed,
)
from tether.errors import FailedPrecondition, InvalidArgument
from tether.ids import new_id
from tether.states import TERMINAL, RunStatus
from tether.tools.base import CallContext, ConnectionGap
from tether.tools.calls import ApprovalRequest, Decision, Paused, ToolCalls
from tether.tools.path import PreparedTool
from tether.tools.path import ToolResult as CallResult

T = TypeVar("T")
# A tool that returns within this is announced in the same checkpoint as its result.
ANNOUNCE_AFTER_S = 0.05


class RunFailed(Exception):
    """A classified failure that ends the run (e.g. a connection gap with no way to consent)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


_ENDED_STATUSES = frozenset(s.value for s in TERMINAL)


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
        self._interactions = interactions
        self._transcript = transcript
        self._checkpoints = checkpoints
        self._registry = registry
        # The delegate calls of this attempt whose children have not ended yet, and those of
        # the calls being run (a turn's, or those a pause left open), in order: a child
        # reserves its share of what the run has left by how many are still to start.
        self._children: list[str] = []
        self._delegates: list[str] = []
        # The last of the calls being run: a delegate call there parks the run with its child.
        self._last_call = ""
        # The children that ended before this lease, by their delegate call.
        self._ended = {
            c.tool_call_id: c for c in assignment.ended_children if c.status in _ENDED_STATUSES
        }
        ports = None if interactions is None else _InteractionsPorts(interactions, assignment)
        self._calls = ToolCalls(
            catalog=registry,
            effects=LeasedEffects(orchestrator, assignment.lease),
            allowlist=list(self._config.tool_allowlist),
            max_inline_bytes=self._config.limits.max_inline_tool_output_bytes or 16_384,
            approvals=ports,
            consent=ports,
            before_fire=checkpoints.sync,
            running=self._while_announced,
        )

    def offer(self, mcp: LeasedTools) -> None:
        """Add the run's MCP tools (offered at lease) to what its calls may use: they take the
        same path as every other tool."""
        if not mcp.tools:
            return
        self._calls.catalog = _WithMcp(self._registry, mcp)
        self._calls.allowlist = [*self._config.tool_allowlist, *mcp.tools]

    def calls(self, tool_calls: Sequence[ToolCall]) -> None:
        """The calls about to be run, in order (a turn's, or those a pause left open)."""
        self._delegates = [c.tool_call_id for c in tool_calls if c.name == DELEGATE]
        self._last_call = tool_calls[-1].tool_call_id if tool_calls else ""

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
        if name == WAIT_UNTIL and name in self._config.tool_allowlist:
            self._wait(tool_call_id=tool_call.tool_call_id, input=input)
            return  # it gave the call its (error) result: the input was refused
        if name == DELEGATE and self._config.delegation is not None:
            await self._delegate(tool_call.tool_call_id, input, new_call=True)
            return  # its child started (the run parks after the turn), or it was refused
        if name == REQUEST_APPROVAL and name in self._config.tool_allowlist:
            name, input = str(input.get("tool_name", "")), dict(input.get("input") or {})
        await self._settle(
            tool_call.tool_call_id,
            name,
            lambda ref: self._calls.call(
                self._call(tool_call.tool_call_id), name, input, output_ref=ref
            ),
        )

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

    def _wait(self, *, tool_call_id: str, input: dict[str, Any]) -> None:
        """Record the call's due time and park until then; a refused input is the call's error
        result (nothing parked), which the model can correct."""
        max_wait = self._config.limits.max_wait_seconds or DEFAULT_MAX_WAIT_S
        try:
            due = due_time(input, datetime.now(UTC), max_wait)
        except WaitRefused as refused:
            self._result(
                tool_call_id, WAIT_UNTIL, str(refused), is_error=True, code="tool_invalid_input"
            )
            return
        self._transcript.add(Role.ASSISTANT, TimerMarker(tool_call_id, rfc3339(due)))
        raise Parked(RunStatus.WAITING_FOR_TIMER, "", wake_at=due, tool_call_id=tool_call_id)

    def _wake(self, tool_call: ToolCall) -> None:
        """Answer a `wait_until` call the run was parked on with the time it woke; park again
        when it came back before its due time, or record it anew when it never parked."""
        markers = [
            p.content
            for p in self._transcript.parts
            if isinstance(p.content, TimerMarker)
            and p.content.tool_call_id == tool_call.tool_call_id
        ]
        if not markers:
            self._wait(tool_call_id=tool_call.tool_call_id, input=dict(tool_call.input))
            return
        due, now = datetime.fromisoformat(markers[-1].due_at), datetime.now(UTC)
        if not woken(due, now):
            raise Parked(
                RunStatus.WAITING_FOR_TIMER, "", wake_at=due, tool_call_id=tool_call.tool_call_id
            )
        self._result(tool_call.tool_call_id, WAIT_UNTIL, woke_text(due, now), is_error=False)

    async def _delegate(self, tool_call_id: str, input: dict[str, Any], *, new_call: bool) -> None:
        """Start (or find: a call an earlier attempt left open, not `new_call`) the call's
        child run: its result when it has ended already, else the call waits with the turn's
        others (`park_children`). A refused input or delegation is the call's error result,
        which the model can act on."""
        delegation = self._config.delegation
        assert delegation is not None
        try:
            agent, message = delegate_input(input, delegation)
        except DelegateRefused as refused:
            self._result(
                tool_call_id, DELEGATE, str(refused), is_error=True, code="tool_invalid_input"
            )
            return
        ended = None if new_call else self._ended.get(tool_call_id)
        if ended is not None:
            # Its child ended before this lease, which says how: no StartChild.
            child = Child(ended.run_id, RunStatus(ended.status), ended.result_text, ended.error)
            content, is_error, code = child_result(child)
            self._result(tool_call_id, DELEGATE, content, is_error=is_error, code=code)
            return
        # The call is durable before its child exists: a later attempt issues it again and
        # finds the same child, never a second. What is not written yet goes with the call,
        # in the child's own transaction.
        carried = await self._checkpoints.carry()
        after = self._delegates
        share = len(after) - after.index(tool_call_id) if tool_call_id in after else 1
        # The calls' last: the run parks on the children not ended in the same transaction as
        # this child starts, when any (its worker then sends no park of its own).
        park = (*self._children, tool_call_id) if tool_call_id == self._last_call else ()
        try:
            child = await self._orchestrator.start_child(
                self._assignment.lease,
                tool_call_id,
                agent,
                message,
                delegation,
                share=share,
                park=park,
                new_call=new_call,
                checkpoint=carried,
            )
        except InvalidArgument as exc:
            self._result(
                tool_call_id, DELEGATE, exc.message, is_error=True, code="tool_invalid_input"
            )
            return
        except FailedPrecondition as exc:
            if exc.code != "cancel_requested":
                raise  # a stale lease: this attempt is over
            # The run is being cancelled (its worker is told at once): the call goes unrun.
            self._result(tool_call_id, DELEGATE, exc.message, is_error=True, code=exc.code)
            return
        if child.parked:
            waiting = tuple(c for c in park if c != tool_call_id or not child.ended)
            self._children = []
            raise Parked(RunStatus.WAITING_FOR_CHILDREN, "", tool_call_ids=waiting, done=True)
        if child.ended:
            content, is_error, code = child_result(child)
            self._result(tool_call_id, DELEGATE, content, is_error=is_error, code=code)
            return
        self._children.append(tool_call_id)

    def park_children(self) -> None:
        """Park the run until the children of this turn's delegate calls have all ended, when
        some have not."""
        if self._children:
            waiting, self._children = tuple(self._children), []
            raise Parked(RunStatus.WAITING_FOR_CHILDREN, "", tool_call_ids=waiting)

    def _call(self, tool_call_id: str) -> CallContext:
        return CallContext(
            tenant_id=self._assignment.tenant_id,
            run_id=self._run_id,
            root_run_id=self._assignment.root_run_id,
            tool_call_id=tool_call_id,
            connections=self._interactions,
        )

    async def _settle(
        self,
        tool_call_id: str,
        name: str,
        call: Callable[[str], Awaitable[CallResult | Paused]],
    ) -> None:
        """Take a call through `ToolCalls` and write what came of it: its result (the whole
        output stored when cut), a pause (marker, then park) or a run that cannot go on."""
        output_ref = new_id("out")
        outcome = await call(output_ref)
        if isinstance(outcome, Paused):
            if outcome.reason == "approval":
                self._transcript.add(
                    Role.ASSISTANT, ApprovalMarker(outcome.interaction_id, outcome.tool_name)
                )
                raise Parked(RunStatus.WAITING_FOR_APPROVAL, outcome.interaction_id)
            self._transcript.add(
                Role.ASSISTANT, ConnectionMarker(outcome.interaction_id, outcome.provider)
            )
            raise Parked(RunStatus.WAITING_FOR_CONNECTION, outcome.interaction_id)
        if outcome.ends_run:
            code = outcome.error_code or "tool_error"
            self._result(tool_call_id, "", outcome.content, is_error=True, code=code)
            raise RunFailed(code, outcome.content)
        if outcome.full_content is not None:
            await self._orchestrator.store_tool_output(
                self._assignment.lease, output_ref, outcome.full_content
            )
        self._result(
            tool_call_id,
            name,
            outcome.content,
            is_error=outcome.is_error,
            code=outcome.error_code,
            replayed=outcome.replayed,
            output_ref=output_ref if outcome.truncated else "",
            truncated=outcome.truncated,
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
        dangling = self._transcript.dangling_tool_calls()
        self.calls(dangling)
        for tool_call in dangling:
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
        if name == WAIT_UNTIL and name in self._config.tool_allowlist:
            self._wake(tool_call)
            return
        if name == DELEGATE and self._config.delegation is not None:
            await self._delegate(tool_call.tool_call_id, input, new_call=False)
            return
        if name == REQUEST_APPROVAL:
            name = str(input.get("tool_name", ""))
        await self._settle(
            tool_call.tool_call_id,
            name,
            lambda ref: self._calls.resume(
                self._call(tool_call.tool_call_id), name, input, output_ref=ref
            ),
        )

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


class _WithMcp:
    """The registry's tools and the run's MCP tools, as one catalog of the call path (an MCP
    name never shadows one the run offers: the offer leaves a colliding tool out)."""

    def __init__(self, registry: ToolRegistry, mcp: LeasedTools) -> None:
        self._registry = registry
        self._mcp = mcp.tools

    def prepared(self, name: str) -> PreparedTool | None:
        return self._mcp.get(name) or self._registry.prepared(name)


class _InteractionsPorts:
    """The approval decision and the connection offer of `ToolCalls`, over the interactions
    service under the attempt's lease."""

    def __init__(self, interactions: LeasedInteractions, assignment: Assignment) -> None:
        self._interactions = interactions
        self._policy = assignment.config.approvals

    async def check_grant(self, tool_name: str, risk: str) -> str | None:
        return await self._interactions.check_grant(tool_name, risk)

    async def request_approval(self, request: ApprovalRequest) -> str:
        return await self._interactions.request_approval(
            tool_call_id=request.tool_call_id,
            tool_name=request.tool_name,
            input=request.input,
            risk=request.risk,
            summary=request.summary,
            policy=self._policy,
            idempotency_key=request.idempotency_key,
        )

    async def claim(self, tool_name: str, tool_call_id: str) -> Decision | None:
        claim = await self._interactions.claim(tool_name, tool_call_id)
        if claim is None:
            return None
        return Decision(claim.interaction_id, claim.decision, claim.tool_name, claim.input)

    async def offer_connection(self, tool_call_id: str, gap: ConnectionGap) -> str | None:
        offer = await self._interactions.offer_connection(tool_call_id, gap)
        return None if offer is None else offer.interaction_id
