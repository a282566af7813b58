"""One attempt of one run, under a lease: the agent loop with its limits.

prepare (context) -> model turn -> tools -> ... -> outcome. The outcome is classified, never
left to chance: completed (maybe with a budget warning), failed with a reason, retry-pending for
a transient provider failure, or cancelled. A stale lease ends the attempt silently: another
worker owns the run now. The loop's helpers have rooms of their own: the checkpoint writer
(`checkpoints`), the gate each tool call passes (`gate`), and the outcome report (`outcomes`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from typing import Any

from anthropic import AsyncAnthropic

from services.worker import observed, sse
from services.worker.checkpoints import CheckpointWriter
from services.worker.compactor import Compactor
from services.worker.context.builder import ContextBuilder, EarlierRun
from services.worker.context.compaction import Budget, request_tokens
from services.worker.context.knowledge import LeasedKnowledge
from services.worker.context.providers import ContextFailed, ContextProviders, Gathered
from services.worker.delegation import DELEGATE, delegate_specs
from services.worker.delivery import Deliverer, DeliverySettings
from services.worker.gate import Gate, RunFailed
from services.worker.interactions import BUILTIN_SPECS, LeasedInteractions, Parked
from services.worker.mcp.tools import LeasedTools, McpToolbox
from services.worker.model import stream_turn
from services.worker.model_limits import ModelReservations, RateLimited, headers_of
from services.worker.orchestrator_client import Orchestrator
from services.worker.outcomes import Outcomes, ms_since
from services.worker.provider_errors import classify_exception
from services.worker.render import context_requests, tool_specs, turn_max_tokens
from services.worker.tools.registry import ToolRegistry
from services.worker.transcript import Transcript
from tether import telemetry
from tether.bus import Bus
from tether.domain import (
    CANCELLED_BY_CALLER,
    Assignment,
    Completed,
    Ending,
    Failed,
    ModelTurn,
    Role,
    RunError,
    Summary,
    ToolCall,
    ToolResult,
    tool_started,
    usage_updated,
)
from tether.errors import TetherError
from tether.pricing import add_usage, cost_micros
from tether.ratelimits import RATE_LIMITED
from tether.retry import ProviderFailure


class LimitReached(Exception):
    """A per-run limit ended the loop; `code` names which."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ProviderError(Exception):
    """A classified provider failure escaping the loop."""

    def __init__(self, failure: ProviderFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


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
        assignment: Assignment,
        *,
        orchestrator: Orchestrator,
        client: AsyncAnthropic,
        registry: ToolRegistry,
        bus: Bus | None,
        checkpoint_interval_s: float,
        interactions: LeasedInteractions | None = None,
        providers: ContextProviders | None = None,
        delivery: DeliverySettings | None = None,
        mcp: McpToolbox | None = None,
    ) -> None:
        self.assignment = assignment
        self._mcp = mcp
        self._interactions = interactions
        self._mcp_tools = LeasedTools({})
        self._orchestrator = orchestrator
        self._providers = providers or ContextProviders([], [])
        # What the run records about its context: optional providers left out.
        self.context_warnings: tuple[str, ...] = ()
        self.lease = assignment.lease
        self.run_id = assignment.run_id
        self.config = assignment.config
        self.limits = assignment.config.limits
        self._client = client
        self._registry = registry
        self._interval = checkpoint_interval_s
        self._task: asyncio.Task[Any] | None = None
        own = assignment.own
        self.transcript = Transcript(own)
        self.state = AttemptState(
            tool_calls=sum(1 for p in own if isinstance(p.content, ToolCall) and not p.superseded)
        )
        self.cancel_reason: str | None = None
        self.checkpoints = CheckpointWriter(
            orchestrator=orchestrator,
            transcript=self.transcript,
            lease=self.lease,
            bus=bus,
            stop_attempt=self.stop_with,
            cancel_requested=self._cancel_requested,
        )
        self._gate = Gate(
            assignment,
            orchestrator=orchestrator,
            registry=registry,
            interactions=interactions,
            transcript=self.transcript,
            checkpoints=self.checkpoints,
        )
        self._reservations = ModelReservations(orchestrator, self.lease, client)
        self._compactor = Compactor(
            client=client,
            orchestrator=orchestrator,
            lease=self.lease,
            transcript=self.transcript,
            config=self.config,
            account=lambda model, usage: self._account(usage, model),
        )
        self.outcomes = Outcomes(
            orchestrator=orchestrator,
            lease=self.lease,
            transcript=self.transcript,
            checkpoints=self.checkpoints,
        )
        self.stages = self.outcomes.stages
        reply = assignment.origin.reply
        self._deliverer = (
            None
            if reply is None or delivery is None
            else Deliverer(
                assignment,
                reply,
                orchestrator=orchestrator,
                interactions=interactions,
                transcript=self.transcript,
                checkpoints=self.checkpoints,
                settings=delivery,
            )
        )

    # -- stopping -------------------------------------------------------------------------------

    @property
    def progressed_at(self) -> float:
        """When the attempt last made progress (time.monotonic): a model event or a landed
        write."""
        return self.transcript.progressed_at

    def stop_with(self, error: Exception) -> None:
        """Stop the attempt where it is, ending with `error` (StaleLease from a heartbeat, or
        a checkpoint that failed: nothing more may be written under this lease)."""
        self.checkpoints.stop(error)
        self._stop_task()

    def _cancel_requested(self) -> None:
        """A checkpoint's answer carried the caller's durable cancel request."""
        self.cancel(CANCELLED_BY_CALLER)

    def cancel(self, reason: str) -> None:
        """Stop the attempt for `reason` (a caller's cancel, the pool's shutdown, no progress)
        unless its outcome is already on its way: then that lands, and the orchestrator ends
        the run cancelled instead if a caller's cancel came first (the outcome's parts kept)."""
        if self.cancel_reason is None:
            self.cancel_reason = reason
            self._stop_task()

    def _stop_task(self) -> None:
        if self.checkpoints.sealed:
            return  # the outcome is on its way; let it land (a stale one is refused there)
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def abandon_delivery(self, why: str) -> None:
        """Give the run's open delivery its outcome when the attempt ends without finishing
        it (`Deliverer.abandon`); nothing for a run that came through no channel."""
        if self._deliverer is not None:
            await self._deliverer.abandon(why)

    # -- the loop -------------------------------------------------------------------------------

    def start(self) -> asyncio.Task[None]:
        """Run `execute` as this attempt's task (the one a stop cancels)."""
        self._task = asyncio.ensure_future(self.execute())
        return self._task

    async def execute(self) -> None:
        """Run to an outcome and report it to the orchestrator."""
        self._task = asyncio.current_task()
        try:
            await self._execute_attempt()
        except asyncio.CancelledError:
            if self.checkpoints.error is not None and self.cancel_reason is None:
                raise self.checkpoints.error from None  # the writer stopped us, not a caller
            raise

    async def _gather(self) -> Gathered:
        """This attempt's live facts and knowledge (see `ContextProviders.gather`)."""
        assignment, policy = self.assignment, self.config.context
        facts, retrieval = context_requests(
            self.config,
            tenant_id=assignment.tenant_id,
            run_id=self.run_id,
            origin=assignment.origin,
            input_text=assignment.input_text,
            has_documents=assignment.has_documents,
        )
        knowledge = LeasedKnowledge(self._orchestrator, self.lease)
        try:
            gathered = await self._providers.gather(policy, facts, retrieval, knowledge)
        except ContextFailed as failed:
            raise RunFailed(failed.code, failed.message) from failed
        self.context_warnings = (*self.context_warnings, *gathered.warnings)
        return gathered

    async def _offer_mcp(self) -> None:
        """The agent's MCP tools for this attempt (see `services.worker.mcp.tools`): offered
        after the built-in ones, and what is left out said on the run."""
        if self._mcp is None or not self.config.mcp_servers:
            return
        secret = None if self._interactions is None else self._interactions.secret
        taken = {*self.config.tool_allowlist, *self._registry.names, *BUILTIN_SPECS, DELEGATE}
        token = None if self._interactions is None else self._interactions.token
        self._mcp_tools = await self._mcp.lease(self.config, secret, taken, token)
        self._gate.offer(self._mcp_tools)
        self.context_warnings = (*self.context_warnings, *self._mcp_tools.warnings)

    def _builder(self, gathered: Gathered) -> ContextBuilder:
        """The context of this attempt's requests: routing's persona, skills and tools, the
        session's history (the latest summary standing in for what it covers), the live facts
        and knowledge gathered."""
        builder = ContextBuilder(
            self.config,
            tools=[
                *tool_specs(self._registry, self.config.tool_allowlist),
                *delegate_specs(self.config),
                *self._mcp_tools.specs,
            ],
            summary=self.assignment.summary,
            earlier=_earlier_runs(self.assignment),
            facts=gathered.facts,
            documents=gathered.documents,
            input_text=self.assignment.input_text,
        )
        own = [p.content for p in self.transcript.parts if isinstance(p.content, Summary)]
        if own:
            builder.compacted(own[-1])  # an earlier attempt of this run compacted
        return builder

    async def _execute_attempt(self) -> None:
        if self._deliverer is not None:
            delivered = await self._deliverer.resume()
            if delivered is not None:
                # An earlier attempt drafted the answer and recorded its delivery: the model
                # is not asked again, and the run completes with what went out.
                await self.outcomes.finish(Completed(delivered.text))
                return
        context_start = time.monotonic()
        loop_start = time.monotonic()
        ending: Ending
        try:
            async with asyncio.timeout(self.limits.wall_clock_seconds or None):
                await self._offer_mcp()
                context = self._builder(await self._gather())
                self.stages["context_ms"] = ms_since(context_start)
                loop_start = time.monotonic()
                await self._gate.resume_paused()
                self._gate.park_children()
                ending = await self._loop(context)
        except TimeoutError:
            budget = f"{self.limits.wall_clock_seconds:g} s"
            ending = Failed(
                RunError(
                    "wall_clock_exceeded", f"the run exceeded its wall-clock budget of {budget}"
                )
            )
        except LimitReached as limit:
            # Runtime completion is not business completion: the runtime answered, the task
            # may not be done.
            warnings = (limit.code, "budget_exhausted")
            ending = Completed(self.transcript.final_text(0), "unresolved", warnings)
        except RunFailed as failure:
            ending = Failed(RunError(failure.code, failure.message))
        except Parked as parked:
            await self.outcomes.parked(parked)
            return
        except ProviderError as failure:
            await self.outcomes.provider_failed(failure.failure)
            return
        except RateLimited as limited:
            # Waits without holding a worker, and spends no attempt (Recovery.schedule_retry).
            error = RunError(RATE_LIMITED, str(limited), True)
            await self.outcomes.retry_later(error, limited.wait_s)
            return
        self.stages["attempt_ms"] = ms_since(loop_start)
        if isinstance(ending, Completed) and self.context_warnings:
            ending = replace(ending, warnings=(*ending.warnings, *self.context_warnings))
        if self._deliverer is not None and isinstance(ending, Completed) and _answered(ending):
            try:
                await self._deliverer.deliver(ending.result_text)
            except Parked as parked:
                await self.outcomes.parked(parked)
                return
        await self.outcomes.finish(ending)

    def _request(self, context: ContextBuilder) -> dict[str, Any]:
        return context.request(
            self.transcript.parts,
            model=self.config.model,
            max_tokens=turn_max_tokens(self.config, self.state.usage.get("output_tokens", 0)),
        )

    async def _within_budget(
        self, context: ContextBuilder, budget: Budget, request: dict[str, Any]
    ) -> dict[str, Any]:
        """The request, its history compacted first when it would exceed the agent's context
        budget (see `services.worker.context.compaction`)."""
        allowed = self.config.context.budget_tokens
        if not allowed:
            return request
        tokens = budget.estimate(context, self.transcript.parts, request)
        if tokens <= allowed:
            return request
        try:
            summary = await self._compactor.compact(context, tokens)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if isinstance(exc, TetherError | LimitReached):
                raise  # our own (a refused store, a stale lease, a ceiling), not the provider's
            raise ProviderError(classify_exception(exc)) from exc
        if summary is not None:
            budget.forget()
            request = self._request(context)
        if request_tokens(request) > allowed and "context_over_budget" not in self.context_warnings:
            # Nothing older is left to summarise: the run goes on, and says so.
            self.context_warnings = (*self.context_warnings, "context_over_budget")
        return request

    async def _loop(self, context: ContextBuilder) -> Completed:
        budget = Budget(
            self.assignment.last_turn_tokens, self.assignment.last_turn_own, self.transcript.parts
        )
        while True:
            if self.state.steps >= self.limits.max_steps:
                raise LimitReached(
                    "max_steps_exceeded", f"the run used its {self.limits.max_steps} model turns"
                )
            request = await self._within_budget(context, budget, self._request(context))
            turn_start_index = self.transcript.next_index
            reservation = 0
            if self._reservations.on:
                estimate = budget.estimate(context, self.transcript.parts, request)
                reservation = await self._reservations.reserve(request, estimate)
            seen = sse.AnswerHeaders()
            try:
                streaming = stream_turn(
                    self._client,
                    request=request,
                    transcript=self.transcript,
                    checkpoint=self.checkpoints.checkpoint,
                    publish_delta=self.checkpoints.publish_delta,
                    checkpoint_interval_s=self._interval,
                    headers=seen if reservation else None,
                )
                if telemetry.on:
                    streaming = observed.model_turn(self.config, request, streaming)
                turn = await streaming
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if reservation:
                    await self._reservations.settle(reservation, request, None, headers_of(exc))
                if isinstance(exc, TetherError):
                    raise  # our own (e.g. StaleLease from a checkpoint), not the provider's
                raise ProviderError(classify_exception(exc)) from exc
            if reservation:
                await self._reservations.settle(
                    reservation, request, turn.usage, seen.values, seen.age_s()
                )
            self.state.steps += 1
            self._account(turn.usage)
            budget.turned(turn.usage, turn_start_index)
            if turn.stop_reason != "tool_use" or not turn.tool_calls:
                # No flush: what is left goes with the completion, in the same transaction.
                warnings = ("max_tokens",) if turn.stop_reason == "max_tokens" else ()
                return Completed(self.transcript.final_text(turn_start_index), warnings=warnings)
            self._gate.calls(turn.tool_calls)
            for call in turn.tool_calls:
                await self._run_tool(call)
            self._gate.park_children()
            self.checkpoints.checkpoint()

    def _account(self, usage: dict[str, int], model: str | None = None) -> None:
        """Count one model call's usage (priced at its own model's rate) against the run's
        ceilings."""
        model = model or self.config.model
        cost = cost_micros(usage, self.config.prices.get(model))
        if telemetry.on:
            observed.turn_used(self.assignment.tenant_id, model, usage, cost)
        turn = ModelTurn(model, **usage, cost_micros=cost)
        self.state.usage = add_usage(self.state.usage, {**usage, "cost_micros": cost})
        self.state.cost_micros += cost
        self.transcript.record_turn(turn)
        self.transcript.record(usage_updated(turn, self.state.usage))
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
            # Reached is spent: each turn is clamped to what is left, so it ends there.
            and self.state.usage.get("output_tokens", 0) >= limits.max_output_tokens
        ):
            raise LimitReached(
                "output_tokens_exceeded",
                f"output tokens passed the ceiling of {limits.max_output_tokens}",
            )
        if limits.max_cost_micros and self.state.cost_micros > limits.max_cost_micros:
            raise LimitReached(
                "cost_exceeded", f"cost passed the ceiling of {limits.max_cost_micros} micro-USD"
            )

    async def _run_tool(self, tool_call: ToolCall) -> None:
        if self.state.tool_calls >= self.limits.max_tool_calls:
            self.transcript.add(
                Role.TOOL,
                ToolResult(
                    tool_call.tool_call_id,
                    "not run: the run reached its tool-call limit",
                    is_error=True,
                ),
            )
            raise LimitReached(
                "max_tool_calls_exceeded",
                f"the run used its {self.limits.max_tool_calls} tool calls",
            )
        self.state.tool_calls += 1
        self.transcript.record(tool_started(tool_call.tool_call_id, tool_call.name))
        await self._gate.run(tool_call)


def _answered(ending: Completed) -> bool:
    """Whether a completion carries an answer for the channel: the model's final turn answered
    (not a limit cutting it short)."""
    return ending.task_outcome == "resolved" and bool(ending.result_text.strip())


def _earlier_runs(assignment: Assignment) -> list[EarlierRun]:
    """The history's earlier runs, each with its parts (spans the orchestrator sent; all as one
    when it sent none, as the previous release does)."""
    prior = tuple(assignment.prior)
    if not assignment.earlier_runs:
        return [EarlierRun("", prior)] if prior else []
    runs, start = [], 0
    for span in assignment.earlier_runs:
        runs.append(EarlierRun(span.run_id, prior[start : start + span.parts]))
        start += span.parts
    return runs
