"""What a claim hands the worker: the lease, the run's facts, its agent's configuration and the
conversation so far, as frozen types. The Work stream's two ends convert them with
`tether.convert.work`; nothing else sees the wire form.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tether.domain.agents import AgentConfig
from tether.domain.channels import ReplyTarget
from tether.domain.outcomes import RunError
from tether.domain.parts import Part, Summary


@dataclass(frozen=True, slots=True)
class Lease:
    """The worker's hold on a run: the orchestrator fences every call under it by `epoch`."""

    run_id: str
    epoch: int
    attempt: int = 0


@dataclass(frozen=True, slots=True)
class Origin:
    """Where the run came from: its source and channel, who sent it, and where its answer goes
    when it came through a channel connection (`reply`)."""

    source: str = ""
    channel: str = ""
    actor_type: str = ""
    actor_id: str = ""
    reply: ReplyTarget | None = None


@dataclass(frozen=True, slots=True)
class EndedChild:
    """A child run that has ended, as its delegate call `tool_call_id` is answered: its answer
    (`result_text`) or why not (`error`)."""

    tool_call_id: str
    run_id: str
    status: str
    result_text: str = ""
    error: RunError | None = None


@dataclass(frozen=True, slots=True)
class EarlierRun:
    """One earlier run in the history: its id and how many history parts are its (its input,
    a user-role text part, first)."""

    run_id: str
    parts: int


@dataclass(frozen=True, slots=True)
class Assignment:
    """A claimed run. `history` is the session's earlier runs (their inputs as user-role text
    parts) followed by this run's own parts; the first `prior_part_count` are the earlier
    runs', spanned by `earlier_runs` (when the orchestrator says so). `summary_part` (a part of
    an earlier run, holding a `summary`) stands in for the runs before them (context
    compaction). `last_turn_tokens` is what the session's last
    model turn reported (input and output; 0 when unknown), and `last_turn_own` whether it was
    this run's."""

    lease: Lease
    tenant_id: str
    root_run_id: str
    input_text: str
    config: AgentConfig
    history: tuple[Part, ...] = ()
    prior_part_count: int = 0
    last_seq: int = 0
    traceparent: str = ""
    origin: Origin = Origin()
    has_documents: bool = False
    summary_part: Part | None = None
    earlier_runs: tuple[EarlierRun, ...] = ()
    last_turn_tokens: int = 0
    last_turn_own: bool = False
    # The run's children that have ended (a run queued again once they had): its delegate
    # calls issued again are answered from here.
    ended_children: tuple[EndedChild, ...] = ()

    @property
    def run_id(self) -> str:
        """The claimed run."""
        return self.lease.run_id

    @property
    def summary(self) -> Summary | None:
        """The summary standing in for the runs before the history, if any."""
        content = None if self.summary_part is None else self.summary_part.content
        return content if isinstance(content, Summary) else None

    @property
    def prior(self) -> Sequence[Part]:
        """The earlier runs' parts."""
        return self.history[: self.prior_part_count]

    @property
    def own(self) -> Sequence[Part]:
        """This run's parts, as earlier attempts left them."""
        return self.history[self.prior_part_count :]
