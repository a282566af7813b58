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
from dataclasses import dataclass, field
from typing import Any

from anthropic import AsyncAnthropic

from services.worker.checkpoints import CheckpointWriter
from services.worker.context import build_messages, system_param
from services.worker.gate import Gate, RunFailed
from services.worker.interactions import BUILTIN_SPECS, LeasedInteractions, Parked
from services.worker.model import stream_turn
from services.worker.orchestrator_client import Orchestrator
from services.worker.outcomes import Outcomes
from services.worker.provider_errors import classify_exception
from services.worker.tools.registry import ToolRegistry
from services.worker.transcript import Transcript, event, tool_result_part
from tether.bus import Bus
from tether.errors import TetherError
from tether.pricing import Price, add_usage, cost_micros
from tether.retry import ProviderFailure
from tether.v1 import common_pb2, orchestrator_pb2


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
        self.run = claim.run
        self.run_id = claim.lease.run_id
        self.epoch = claim.lease.epoch
        self.config = claim.config
        self.limits = claim.config.limits
        self._client = client
        self._registry = registry
        self._interval = checkpoint_interval_s
        self._task: asyncio.Task[Any] | None = None
        own = list(claim.history[claim.prior_part_count :])
        self.transcript = Transcript(own)
        self.state = AttemptState(
            tool_calls=sum(
                1 for p in own if p.WhichOneof("kind") == "tool_call" and not p.superseded
            )
        )
        self.cancel_reason: str | None = None
        self._prices = {
            p.model: Price(p.input, p.output, p.cache_write, p.cache_read)
            for p in self.config.prices
        }
        self.checkpoints = CheckpointWriter(
            orchestrator=orchestrator,
            transcript=self.transcript,
            run_id=self.run_id,
            epoch=self.epoch,
            bus=bus,
            stop_attempt=self.stop_with,
            cancel_requested=self._cancel_requested,
        )
        self._gate = Gate(
            claim,
            orchestrator=orchestrator,
            registry=registry,
            interactions=interactions,
            transcript=self.transcript,
            checkpoints=self.checkpoints,
        )
        self.outcomes = Outcomes(
            orchestrator=orchestrator,
            run_id=self.run_id,
            epoch=self.epoch,
            transcript=self.transcript,
            checkpoints=self.checkpoints,
        )
        self.stages = self.outcomes.stages

    # -- stopping -------------------------------------------------------------------------------

    def stop_with(self, error: Exception) -> None:
        """Stop the attempt where it is, ending with `error` (StaleLease from a heartbeat, or
        a checkpoint that failed: nothing more may be written under this lease)."""
        self.checkpoints.stop(error)
        self._stop_task()

    def _cancel_requested(self) -> None:
        """A checkpoint's answer carried the caller's durable cancel request."""
        if self.cancel_reason is None:
            self.cancel_reason = "cancelled by caller"
            self._stop_task()

    def _stop_task(self) -> None:
        if self.checkpoints.sealed:
            return  # the outcome is on its way; let it land (a stale one is refused there)
        if self._task is not None and not self._task.done():
            self._task.cancel()

    # -- the loop -------------------------------------------------------------------------------

    async def execute(self) -> None:
        """Run to an outcome and report it to the orchestrator."""
        self._task = asyncio.current_task()
        try:
            await self._execute_attempt()
        except asyncio.CancelledError:
            if self.checkpoints.error is not None and self.cancel_reason is None:
                raise self.checkpoints.error from None  # the writer stopped us, not a caller
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
                await self._gate.resume_paused()
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
            await self.outcomes.parked(parked)
            return
        except ProviderError as failure:
            await self.outcomes.provider_failed(failure.failure)
            return
        self.stages["attempt_ms"] = (time.monotonic() - loop_start) * 1000
        await self.outcomes.finish(*outcome)

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
                    checkpoint=self.checkpoints.checkpoint,
                    publish_delta=self.checkpoints.publish_delta,
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
            self.checkpoints.checkpoint()

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
        await self._gate.run(tool_call)
