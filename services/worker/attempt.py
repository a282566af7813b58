"""One attempt of one run, under a lease: the agent loop with its limits.

prepare (context) -> model turn -> tools -> ... -> outcome. The outcome is classified, never
left to chance: completed (maybe with a budget warning), failed with a reason, retry-pending for
a transient provider failure, or cancelled. A stale lease ends the attempt silently: another
worker owns the run now.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from anthropic import AsyncAnthropic
from google.protobuf import json_format

from services.worker.context import build_messages, system_param
from services.worker.interactions import (
    ASK_QUESTIONS,
    BUILTIN_SPECS,
    REQUEST_APPROVAL,
    LeasedInteractions,
    Parked,
    answers_text,
)
from services.worker.model import stream_turn
from services.worker.orchestrator_client import LeasedEffects, Orchestrator
from services.worker.provider_errors import classify_exception
from services.worker.tools.base import GATED_RISKS, Authorization, CallContext, ConnectionGap
from services.worker.tools.effects import idempotency_key
from services.worker.tools.registry import ToolErrorCode, ToolRegistry
from services.worker.transcript import Transcript, event, tool_result_part
from tether.bus import Bus
from tether.errors import InvalidArgument, TetherError
from tether.hints import LiveMessage, encode_event, events_channel
from tether.ids import new_id
from tether.pricing import Price, add_usage, cost_micros
from tether.retry import ProviderFailure
from tether.v1 import common_pb2, orchestrator_pb2

log = logging.getLogger(__name__)

T = TypeVar("T")
# A tool that returns within this is announced in the same checkpoint as its result.
ANNOUNCE_AFTER_S = 0.05


class LimitReached(Exception):
    """A per-run limit ended the loop; `code` names which."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class AttemptState:
    """Counters the limits are checked against."""

    steps: int = 0
    tool_calls: int = 0
    usage: dict[str, int] = field(default_factory=dict)
    cost_micros: int = 0


class Attempt:
    """Runs one leased attempt to its outcome."""

    def __init__(
        self,
        claim: orchestrator_pb2.ClaimRunResponse,
        *,
        orchestrator: Orchestrator,
        client: AsyncAnthropic,
        registry: ToolRegistry,
        bus: Bus | None,
        checkpoint_interval_s: float,
        interactions: LeasedInteractions | None = None,
    ) -> None:
        self.claim = claim
        self._interactions = interactions
        self.run = claim.run
        self.run_id = claim.lease.run_id
        self.epoch = claim.lease.epoch
        self.config = claim.config
        self.limits = claim.config.limits
        self._orchestrator = orchestrator
        self._client = client
        self._registry = registry
        self._bus = bus
        self._interval = checkpoint_interval_s
        self._writer: asyncio.Task[None] | None = None
        self._batches = 0  # checkpoints sent under this lease
        self._in_flight: orchestrator_pb2.CheckpointRequest | None = None
        self._write_wanted = False
        self._write_error: Exception | None = None
        self._task: asyncio.Task[Any] | None = None
        self._completing = False
        self._held_deltas: list[tuple[int, str, int]] = []  # (part index, text, offset)
        self._deltas_due = False
        own = list(claim.history[claim.prior_part_count :])
        self.transcript = Transcript(own)
        self.state = AttemptState(
            tool_calls=sum(
                1 for p in own if p.WhichOneof("kind") == "tool_call" and not p.superseded
            )
        )
        self.started = time.monotonic()
        self.stages: dict[str, float] = {}
        self.cancel_reason: str | None = None
        self._prices = {
            p.model: Price(p.input, p.output, p.cache_write, p.cache_read)
            for p in self.config.prices
        }

    # -- checkpointing ------------------------------------------------------------------------

    # Write-behind: a checkpoint is sent by one background writer per attempt while the attempt
    # streams and runs tools, so a turn never waits on the database; one writer keeps them in
    # order, and what piles up while one is in flight goes in the next. The barriers are
    # `sync()` (before parking, a retry, a release, and an external side effect: nothing fires
    # before its call is durable). The completion does not wait: it carries whatever is left
    # and the checkpoint still in flight (numbered, so it lands once whichever comes first).

    def checkpoint(self) -> None:
        """Send what changed since the last checkpoint, behind the attempt's back."""
        self._write_wanted = True
        if self._writer_idle():
            self._writer = asyncio.create_task(self._write(), name=f"checkpoint-{self.run_id}")

    async def _write(self) -> None:
        while self._write_wanted and self._write_error is None and not self._completing:
            self._write_wanted = False
            if not self.transcript.pending:
                continue
            self._batches += 1
            self._in_flight = self._pending_request(batch=self._batches)
            try:
                response = await self._orchestrator.checkpoint(self._in_flight)
            except Exception as exc:
                if self._completing:
                    return  # the completion carried this batch; its answer decides
                # Fenced out, the orchestrator gone, or a bug: the attempt stops where it is.
                self.stop_with(exc)
                return
            finally:
                self._in_flight = None
            if response.cancel_requested and self.cancel_reason is None:
                self.cancel_reason = "cancelled by caller"
                self._stop_task()
        self._release_deltas()  # idle: every event recorded before them has landed

    def _pending_request(self, *, batch: int) -> orchestrator_pb2.CheckpointRequest:
        """What changed since the last checkpoint, as batch number `batch`."""
        parts, events, turns = self.transcript.take()
        return orchestrator_pb2.CheckpointRequest(
            run_id=self.run_id,
            epoch=self.epoch,
            parts=[orchestrator_pb2.PartWrite(part=p) for p in parts],
            events=events,
            turns=turns,
            batch=batch,
        )

    def stop_with(self, error: Exception) -> None:
        """Stop the attempt where it is, ending with `error` (e.g. StaleLease from a heartbeat:
        nothing more may be written under this lease)."""
        if self._write_error is None:
            self._write_error = error
        self._stop_task()

    def _stop_task(self) -> None:
        if self._completing:
            return  # the outcome is on its way; let it land (a stale one is refused there)
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def _writer_idle(self) -> bool:
        return self._writer is None or self._writer.done()

    async def sync(self) -> None:
        """Checkpoint what changed and wait until every requested checkpoint has landed;
        raise what stopped the writer."""
        if self.transcript.pending:
            self.checkpoint()
        if self._writer is not None:
            await asyncio.shield(self._writer)
        if self._write_error is not None:
            raise self._write_error

    async def publish_delta(self, part_index: int, text: str, offset: int) -> None:
        """Live token delta for subscribers (ephemeral, seq 0). Deltas are posted once the
        loop comes round (what arrived in one read goes out as one message), and while a
        checkpoint is in flight they wait for it: a delta never overtakes an event recorded
        before it."""
        if self._bus is None:
            return
        held = self._held_deltas
        if held and held[-1][0] == part_index and held[-1][2] + len(held[-1][1]) == offset:
            held[-1] = (part_index, held[-1][1] + text, held[-1][2])
        else:
            held.append((part_index, text, offset))
        if not self._deltas_due:
            self._deltas_due = True
            asyncio.get_running_loop().call_soon(self._post_deltas)

    def _post_deltas(self) -> None:
        self._deltas_due = False
        if self._writer_idle():
            self._release_deltas()
        # else the writer posts them when it goes idle

    async def _deltas_out(self) -> None:
        """Post the held deltas and wait (bounded) until they reached Redis: the orchestrator
        may answer the next call with part.superseded for their parts, which must not overtake
        them. Only when the writer is idle (after `sync`)."""
        self._release_deltas()
        if self._bus is not None:
            await self._bus.delivered()

    def _release_deltas(self) -> None:
        if self._bus is not None:
            for part_index, text, offset in self._held_deltas:
                self._bus.post(
                    events_channel(self.run_id), _delta_json(self.run_id, part_index, text, offset)
                )
        self._held_deltas.clear()

    # -- the loop -------------------------------------------------------------------------------

    async def execute(self) -> None:
        """Run to an outcome and report it to the orchestrator."""
        self._task = asyncio.current_task()
        try:
            await self._execute_attempt()
        except asyncio.CancelledError:
            if self._write_error is not None and self.cancel_reason is None:
                raise self._write_error from None  # the writer stopped us, not a caller
            raise

    async def _execute_attempt(self) -> None:
        context_start = time.monotonic()
        allowlist = list(self.config.tool_allowlist)
        tools = [
            *self._registry.specs(allowlist),
            *(BUILTIN_SPECS[n] for n in allowlist if n in BUILTIN_SPECS),
        ]
        self.stages["context_ms"] = (time.monotonic() - context_start) * 1000
        loop_start = time.monotonic()
        try:
            async with asyncio.timeout(self.limits.wall_clock_seconds or None):
                await self._resume_paused()
                outcome = await self._loop(tools)
        except TimeoutError:
            outcome = (
                "failed",
                {
                    "code": "wall_clock_exceeded",
                    "retryable": False,
                    "message": f"the run exceeded its wall-clock budget of "
                    f"{self.limits.wall_clock_seconds:g} s",
                },
            )
        except LimitReached as limit:
            outcome = ("limit", {"code": limit.code, "message": limit.message})
        except RunFailed as failure:
            outcome = (
                "failed",
                {"code": failure.code, "message": failure.message, "retryable": False},
            )
        except Parked as parked:
            await self.sync()
            await self._orchestrator.park(
                self.run_id, self.epoch, parked.status, parked.interaction_id
            )
            return
        except ProviderError as failure:
            await self._provider_failed(failure.failure)
            return
        self.stages["attempt_ms"] = (time.monotonic() - loop_start) * 1000
        await self._finish(*outcome)

    async def _loop(self, tools: list[dict[str, Any]]) -> tuple[str, dict[str, Any] | None]:
        turn_start_index = self.transcript.next_index
        while True:
            if self.state.steps >= self.limits.max_steps:
                raise LimitReached(
                    "max_steps_exceeded", f"the run used its {self.limits.max_steps} model turns"
                )
            request = {
                "model": self.config.model,
                "max_tokens": self.limits.max_tokens_per_turn or 1024,
                "system": system_param(self.config),
                "messages": build_messages(
                    [*self.claim.history[: self.claim.prior_part_count], *self.transcript.parts],
                    self.claim.prior_part_count,
                    self.run.input_text,
                ),
            }
            if tools:
                request["tools"] = tools
            turn_start_index = self.transcript.next_index
            try:
                turn = await stream_turn(
                    self._client,
                    request=request,
                    transcript=self.transcript,
                    checkpoint=self.checkpoint,
                    publish_delta=self.publish_delta,
                    checkpoint_interval_s=self._interval,
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if isinstance(exc, TetherError):
                    raise  # our own (e.g. StaleLease from a checkpoint), not the provider's
                raise ProviderError(classify_exception(exc)) from exc
            self.state.steps += 1
            self._account(turn.usage)
            if turn.stop_reason != "tool_use" or not turn.tool_calls:
                # No flush: what is left goes with the completion, in the same transaction.
                warnings = ["max_tokens"] if turn.stop_reason == "max_tokens" else []
                return "completed", {"warnings": warnings, "since": turn_start_index}
            for call in turn.tool_calls:
                await self._run_tool(call)
            self.checkpoint()

    def _account(self, usage: dict[str, int]) -> None:
        turn = {**usage, "model": self.config.model}
        self.transcript.turns.append(common_pb2.Usage(model=self.config.model, **usage))
        cost = cost_micros(usage, self._prices.get(self.config.model))
        self.state.usage = add_usage(self.state.usage, {**turn, "cost_micros": cost})
        self.state.cost_micros += cost
        self.transcript.events.append(
            event(
                "usage.updated",
                turn={**usage, "model": self.config.model, "cost_micros": cost},
                total=self.state.usage,
            )
        )
        limits = self.limits
        if (
            limits.max_input_tokens
            and self.state.usage.get("input_tokens", 0) > limits.max_input_tokens
        ):
            raise LimitReached(
                "input_tokens_exceeded",
                f"input tokens passed the ceiling of {limits.max_input_tokens}",
            )
        if (
            limits.max_output_tokens
            and self.state.usage.get("output_tokens", 0) > limits.max_output_tokens
        ):
            raise LimitReached(
                "output_tokens_exceeded",
                f"output tokens passed the ceiling of {limits.max_output_tokens}",
            )
        if limits.max_cost_micros and self.state.cost_micros > limits.max_cost_micros:
            raise LimitReached(
                "cost_exceeded", f"cost passed the ceiling of {limits.max_cost_micros} micro-USD"
            )

    async def _run_tool(self, call: common_pb2.Part) -> None:
        tool_call = call.tool_call
        if self.state.tool_calls >= self.limits.max_tool_calls:
            self.transcript.add(
                tool_result_part(
                    tool_call.tool_call_id,
                    "not run: the run reached its tool-call limit",
                    is_error=True,
                )
            )
            raise LimitReached(
                "max_tool_calls_exceeded",
                f"the run used its {self.limits.max_tool_calls} tool calls",
            )
        self.state.tool_calls += 1
        self.transcript.events.append(
            event("tool.started", tool_call_id=tool_call.tool_call_id, name=tool_call.name)
        )
        name, input = tool_call.name, json_format.MessageToDict(tool_call.input)
        if name == ASK_QUESTIONS and name in self.config.tool_allowlist:
            await self._ask(tool_call.tool_call_id, input)
            return  # it parked, or it gave the call its one (error) result
        if name == REQUEST_APPROVAL and name in self.config.tool_allowlist:
            name, input = str(input.get("tool_name", "")), dict(input.get("input") or {})
        if name not in self.config.tool_allowlist:
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
        self.transcript.add(
            common_pb2.Part(
                role="assistant",
                final=True,
                question=common_pb2.QuestionPart(interaction_id=interaction_id),
            )
        )
        raise Parked(common_pb2.RUN_STATUS_WAITING_FOR_QUESTION, interaction_id)

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
            return Authorization("grant", grant, name, self.run_id)
        normalised, problem = self._registry.validate_input(name, input)
        if problem:
            return None  # nobody is asked to authorise a call that cannot succeed
        interaction_id = await self._interactions.request_approval(
            tool_call_id=tool_call_id,
            tool_name=name,
            input=normalised,
            risk=risk,
            summary=_summary(name, normalised),
            idempotency_key=idempotency_key(self.run.tenant_id, self.run_id, name, normalised),
        )
        self.transcript.add(
            common_pb2.Part(
                role="assistant",
                final=True,
                approval=common_pb2.ApprovalPart(interaction_id=interaction_id, tool_name=name),
            )
        )
        raise Parked(common_pb2.RUN_STATUS_WAITING_FOR_APPROVAL, interaction_id)

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
            await self.sync()  # the call is durable before its side effect can fire
        try:
            result = await self._while_announced(
                self._registry.execute(
                    name,
                    input,
                    CallContext(
                        tenant_id=self.run.tenant_id,
                        run_id=self.run_id,
                        root_run_id=self.run.root_run_id or self.run_id,
                        tool_call_id=tool_call_id,
                        connections=self._interactions,
                    ),
                    effects=LeasedEffects(self._orchestrator, self.run_id, self.epoch),
                    allowlist=list(self.config.tool_allowlist),
                    max_inline_bytes=self.limits.max_inline_tool_output_bytes or 16_384,
                    output_ref=output_ref,
                    authorization=authorization,
                )
            )
        except ConnectionGap as gap:
            await self._connection_gap(tool_call_id, gap)
            return
        if result.full_content is not None:
            await self._store_output(output_ref, result.full_content)
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
                self.checkpoint()
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
        interaction_id, _ = offer
        self.transcript.add(
            common_pb2.Part(
                role="assistant",
                final=True,
                connection=common_pb2.ConnectionPart(
                    interaction_id=interaction_id, provider=gap.provider
                ),
            )
        )
        raise Parked(common_pb2.RUN_STATUS_WAITING_FOR_CONNECTION, interaction_id)

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
        self.transcript.add(
            tool_result_part(
                tool_call_id, content, is_error=is_error, output_ref=output_ref, truncated=truncated
            )
        )
        if is_error:
            self.transcript.events.append(
                event(
                    "tool.failed",
                    tool_call_id=tool_call_id,
                    name=name,
                    error={"code": code or "tool_error", "message": content},
                )
            )
        else:
            self.transcript.events.append(
                event("tool.completed", tool_call_id=tool_call_id, name=name, replayed=replayed)
            )

    async def _resume_paused(self) -> None:
        """Finish the calls a pause left open: answers become the call's result (a user-role
        line in the history), a claimed approval runs its stored input, a completed consent
        runs the call again."""
        for call in self.transcript.dangling_tool_calls():
            tool_call = call.tool_call
            name, input = tool_call.name, json_format.MessageToDict(tool_call.input)
            if name == ASK_QUESTIONS:
                await self._deliver_answers(tool_call.tool_call_id)
                continue
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
            json_format.MessageToDict(claim.input),
            Authorization("approval", claim.interaction_id, claim.tool_name, self.run_id),
        )

    async def _store_output(self, ref: str, content: str) -> None:
        await self._orchestrator.stub.StoreToolOutput(
            orchestrator_pb2.StoreToolOutputRequest(
                run_id=self.run_id, epoch=self.epoch, output_ref=ref, content=content
            )
        )

    # -- outcomes -----------------------------------------------------------------------------

    async def _finish(self, kind: str, detail: dict[str, Any] | None) -> None:
        final_start = time.monotonic()
        request = orchestrator_pb2.CompleteRunRequest(run_id=self.run_id, epoch=self.epoch)
        detail = detail or {}
        if kind == "completed":
            request.status = common_pb2.RUN_STATUS_COMPLETED
            request.result_text = self.transcript.final_text(detail.get("since", 0))
            request.task_outcome = "resolved"
            request.warnings.extend(detail.get("warnings", []))
        elif kind == "limit":
            # Runtime completion is not business completion: the runtime answered, the task
            # may not be done.
            self.transcript.close_dangling("the run reached a limit")
            request.status = common_pb2.RUN_STATUS_COMPLETED
            request.result_text = self.transcript.final_text(0)
            request.task_outcome = "unresolved"
            request.warnings.extend([detail["code"], "budget_exhausted"])
        else:
            self.transcript.close_dangling("the run failed")
            request.status = common_pb2.RUN_STATUS_FAILED
            request.error.CopyFrom(
                common_pb2.ErrorInfo(
                    code=detail.get("code", "error"),
                    message=detail.get("message", ""),
                    retryable=bool(detail.get("retryable", False)),
                )
            )
        await self._complete(request, final_start)

    async def cancelled(self) -> None:
        """Finalise as cancelled: dangling calls closed as interrupted."""
        final_start = time.monotonic()
        self.transcript.close_dangling("the run was cancelled")
        request = orchestrator_pb2.CompleteRunRequest(
            run_id=self.run_id,
            epoch=self.epoch,
            status=common_pb2.RUN_STATUS_CANCELLED,
            error=common_pb2.ErrorInfo(code="cancelled", message=self.cancel_reason or ""),
        )
        await self._complete(request, final_start)

    async def released(self) -> None:
        """Graceful shutdown: persist progress, close open calls, hand the lease back."""
        self.transcript.close_dangling("the worker shut down")
        await self.sync()
        await self._deltas_out()
        await self._orchestrator.release(self.run_id, self.epoch)

    async def _complete(self, request: orchestrator_pb2.CompleteRunRequest, start: float) -> None:
        if self._write_error is not None:
            raise self._write_error
        # From here the writer sends nothing more: one round trip carries the rest, and the
        # checkpoint still in flight rides along instead of being waited for.
        self._completing = True
        if self._in_flight is not None:
            request.in_flight.CopyFrom(self._in_flight)
        if self._writer_idle():
            self._release_deltas()
        else:
            # Held behind the checkpoint in flight, they could only go out after the terminal
            # event now; their parts go whole with the completion instead.
            self._held_deltas.clear()
        rest = self._pending_request(batch=0)
        request.parts.extend(rest.parts)
        request.turns.extend(rest.turns)
        request.events.extend(rest.events)
        self.stages["finalisation_ms"] = (time.monotonic() - start) * 1000
        self.stages["total_ms"] = (time.monotonic() - self.started) * 1000
        request.stages.CopyFrom(
            orchestrator_pb2.StageDurations(
                **{
                    k: v
                    for k, v in self.stages.items()
                    if k
                    in ("routing_ms", "context_ms", "attempt_ms", "finalisation_ms", "total_ms")
                }
            )
        )
        await self._orchestrator.complete(request)

    async def _provider_failed(self, failure: ProviderFailure) -> None:
        error = common_pb2.ErrorInfo(
            code=str(failure.code),
            message=failure.message,
            retryable=failure.retryable,
            provider_status=failure.status or 0,
        )
        if failure.retryable:
            await self.sync()
            await self._deltas_out()
            await self._orchestrator.schedule_retry(
                self.run_id, self.epoch, error, failure.retry_after or 0.0
            )
            return
        self.transcript.close_dangling("the model call failed")
        request = orchestrator_pb2.CompleteRunRequest(
            run_id=self.run_id, epoch=self.epoch, status=common_pb2.RUN_STATUS_FAILED, error=error
        )
        await self._complete(request, time.monotonic())


class RunFailed(Exception):
    """A classified failure that ends the run (e.g. a connection gap with no way to consent)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _summary(name: str, input: dict[str, Any]) -> str:
    shown = ", ".join(f"{k}={str(v)[:80]!r}" for k, v in sorted(input.items()))
    return f"Run {name}({shown})"


class ProviderError(Exception):
    """A classified provider failure escaping the loop."""

    def __init__(self, failure: ProviderFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


def _delta_json(run_id: str, part_index: int, text: str, offset: int) -> str:
    payload = {"partIndex": part_index, "text": text, "offset": offset}
    return encode_event(LiveMessage(run_id, 0, "text.delta", payload))
