"""The compaction of an attempt's context (see `services.worker.context.compaction` for the
rules): the summary's model call, its usage counted like any turn's, and its storage under the
lease before the next model call."""

from __future__ import annotations

import time
from collections.abc import Callable

from anthropic import AsyncAnthropic

from services.worker import sse
from services.worker.context.builder import ContextBuilder
from services.worker.context.compaction import (
    history_tokens,
    plan,
    summarised,
    summary_max_tokens,
    summary_request,
    transcript_text,
)
from services.worker.model import usage_of
from services.worker.orchestrator_client import Orchestrator
from services.worker.provider_errors import StreamIncomplete
from services.worker.transcript import Transcript
from tether.domain import AgentConfig, Lease, Part, Role, Summary, context_compacted, part_added
from tether.errors import FailedPrecondition

# Counts a model call's usage against the run's ceilings: (model, usage).
Account = Callable[[str, dict[str, int]], None]


class Compactor:
    """Summarises the oldest runs of one attempt's context when it outgrows the budget."""

    def __init__(
        self,
        *,
        client: AsyncAnthropic,
        orchestrator: Orchestrator,
        lease: Lease,
        transcript: Transcript,
        config: AgentConfig,
        account: Account,
    ) -> None:
        self._client = client
        self._orchestrator = orchestrator
        self._lease = lease
        self._transcript = transcript
        self._config = config
        self._account = account

    async def compact(self, context: ContextBuilder, tokens_before: int) -> Summary | None:
        """Summarise what the budget cannot keep and store it; the summary, or None when there
        is no earlier run to summarise. A provider's failure is raised as it came."""
        budget = self._config.context.budget_tokens
        history_before = history_tokens(context)
        longest = summary_max_tokens(budget)
        # What the request holds besides the history, and the summary, within half the budget.
        keep = max(0, budget // 2 - (tokens_before - history_before) - longest)
        chosen = plan(context.earlier, keep_tokens=keep)
        if chosen is None:
            return None
        model = self._config.context.compaction_model or self._config.model
        text = transcript_text(context.summary, chosen.compact)
        written, usage = await self._summarise(summary_request(model, longest, text))
        self._account(model, usage)
        summary = summarised(
            context.summary,
            chosen,
            written or "(nothing to remember)",
            tokens_before=tokens_before,
            history_before=history_before,
        )
        part = Part(self._transcript.next_index, Role.ASSISTANT, summary, final=True)
        events = [part_added(part), context_compacted(part.index, summary)]
        try:
            await self._orchestrator.store_summary(self._lease, part, events)
        except FailedPrecondition as exc:
            # Our own store, sent again after a reconnect, found itself already there: the
            # range has its one summary.
            if exc.code != "summary_exists":
                raise
        self._transcript.append_stored(part)
        context.compacted(summary)
        return summary

    async def _summarise(self, request: dict[str, object]) -> tuple[str, dict[str, int]]:
        """Stream the summary call: its text and usage."""
        text: list[str] = []
        usage: dict[str, int] = {}
        stop_reason = None
        async for event in sse.events(self._client, request):
            kind = event["type"]
            if kind == "message_start":
                usage = usage_of(event["message"].get("usage"))
            elif kind == "content_block_delta" and event["delta"].get("type") == "text_delta":
                text.append(event["delta"]["text"])
                self._transcript.progressed_at = time.monotonic()  # the watchdog sees progress
            elif kind == "message_delta":
                stop_reason = event["delta"].get("stop_reason")
                usage.update({k: v for k, v in usage_of(event.get("usage")).items() if v})
        if stop_reason is None:
            raise StreamIncomplete("the summary's stream ended before message_stop")
        return "".join(text).strip(), usage
