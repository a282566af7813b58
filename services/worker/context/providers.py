"""Live-fact providers and retrievers: pluggable, loaded from entry points like the tools.

A live-fact provider (entry point group `tether.facts`) gives one small, fresh value for an
attempt: the conversation's channel, the actor's name, the time in the tenant's zone. A
retriever (`tether.retrievers`) gives the documents that bear on the run's new message. An entry
point names the provider itself or a callable that takes the settings meant for it (a mapping:
the worker's `TETHER_TOOL_...` settings, see `services.worker.plugins`) and returns one. Each
declares its `name`, whether it is `required`, and its `deadline_s`; the agent's context policy
names which ones an attempt runs.

`gather` runs them all at once, each under its deadline, before any model call. A required one
that fails, misses its deadline or is not installed on this worker fails the run with a
classified reason (`live_fact_failed`, `knowledge_failed`, ... see `ContextFailed`); an optional
one is left out and the run records a warning (`live_fact_omitted:<name>`,
`knowledge_omitted:<name>`). `services.worker.context.conformance` is the suite every
implementation must pass.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from importlib.metadata import entry_points
from typing import Any, Protocol, TypeVar, runtime_checkable

from services.worker.context.builder import Document, Fact
from tether.domain import ContextPolicy

log = logging.getLogger(__name__)

FACTS_GROUP = "tether.facts"
RETRIEVERS_GROUP = "tether.retrievers"
# What one fact may say: a line, not a document (knowledge is for those).
MAX_FACT_CHARS = 500

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class FactRequest:
    """What a live-fact provider is asked with: the run, where it came from and who sent it,
    the tenant's time zone, and the attempt's clock (aware, UTC)."""

    tenant_id: str
    run_id: str
    source: str
    channel: str
    actor_type: str
    actor_id: str
    timezone: str
    now: datetime


@runtime_checkable
class FactProvider(Protocol):
    """Gives one live fact for an attempt."""

    name: str
    required: bool
    deadline_s: float

    async def fact(self, request: FactRequest) -> str | None:
        """The fact's value (one line, at most MAX_FACT_CHARS), or None when there is nothing
        to say for this run; raise when it cannot be known."""
        ...


@dataclass(frozen=True, slots=True)
class RetrievalRequest:
    """What a retriever is asked with: the run's tenant, the text to match (the run's new
    message), how many documents and how much of each, and whether the tenant has documents in
    Tether's own store (the built-in retriever asks for nothing otherwise)."""

    tenant_id: str
    run_id: str
    query: str
    limit: int
    max_chars: int
    has_documents: bool


class KnowledgePort(Protocol):
    """The search of Tether's own document store for the run being built, fenced by its lease
    (only its tenant's documents)."""

    async def search(self, query: str, *, limit: int, max_chars: int) -> list[Document]:
        """The matching documents, best first."""
        ...


@runtime_checkable
class Retriever(Protocol):
    """Gives the documents that bear on a run's new message."""

    name: str
    required: bool
    deadline_s: float

    async def retrieve(
        self, request: RetrievalRequest, knowledge: KnowledgePort
    ) -> Sequence[Document]:
        """At most `request.limit` documents, each text at most `request.max_chars`, of the
        run's tenant only, best first."""
        ...


class ContextFailed(Exception):
    """A required provider failed: the run fails with `code` before any model call."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Gathered:
    """What the providers gave an attempt, and what was left out."""

    facts: tuple[Fact, ...] = ()
    documents: tuple[Document, ...] = ()
    warnings: tuple[str, ...] = field(default_factory=tuple)


class ContextProviders:
    """The live-fact providers and retrievers this worker runs, by name."""

    def __init__(self, facts: Sequence[FactProvider], retrievers: Sequence[Retriever]) -> None:
        self.facts = _by_name(facts, "live-fact provider")
        self.retrievers = _by_name(retrievers, "retriever")

    @classmethod
    def from_entry_points(cls, *, settings: Mapping[str, str]) -> ContextProviders:
        """Every provider registered under the two groups. One that fails to load fails the
        worker at startup (a run needing it would fail later, less plainly)."""
        facts = [
            _load(ep.load(), ep.name, settings, FactProvider)
            for ep in entry_points(group=FACTS_GROUP)
        ]
        retrievers = [
            _load(ep.load(), ep.name, settings, Retriever)
            for ep in entry_points(group=RETRIEVERS_GROUP)
        ]
        return cls(facts, retrievers)

    async def gather(
        self,
        policy: ContextPolicy,
        facts: FactRequest,
        retrieval: RetrievalRequest,
        knowledge: KnowledgePort,
    ) -> Gathered:
        """Run the policy's providers at once, each under its deadline; ContextFailed for a
        required one that fails (the others are stopped first: nothing is left running)."""
        fact_providers = [self._fact_provider(name) for name in policy.live_facts]
        retriever = None
        if policy.retriever and retrieval.limit > 0:
            retriever = self._retriever(policy.retriever)
        jobs = [_Job("live_fact", p, p.fact(facts)) for p in fact_providers]
        if retriever is not None:
            jobs.append(_Job("knowledge", retriever, retriever.retrieve(retrieval, knowledge)))
        tasks = [asyncio.ensure_future(_within(job.deadline_s, job.work)) for job in jobs]
        try:
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for task in tasks:
                task.cancel()
        found_facts: list[Fact] = []
        documents: list[Document] = []
        warnings: list[str] = []
        for job, outcome in zip(jobs, outcomes, strict=True):
            kind, name, deadline = job.kind, job.name, job.deadline_s
            if isinstance(outcome, asyncio.CancelledError):
                raise outcome
            if isinstance(outcome, BaseException):
                why = (
                    f"missed its deadline of {deadline:g} s"
                    if isinstance(outcome, TimeoutError)
                    else f"failed: {type(outcome).__name__}: {outcome}"
                )
                if job.required:
                    code = "timed_out" if isinstance(outcome, TimeoutError) else "failed"
                    raise ContextFailed(f"{kind}_{code}", f"the {_words(kind)} {name!r} {why}")
                log.warning("optional %s %s left out: %s", _words(kind), name, why)
                warnings.append(f"{kind}_omitted:{name}")
            elif kind == "live_fact":
                value = _fact_value(outcome)
                if value:
                    found_facts.append(Fact(name, value))
            else:
                documents.extend(outcome[: retrieval.limit])
        return Gathered(tuple(found_facts), tuple(documents), tuple(warnings))

    def _fact_provider(self, name: str) -> FactProvider:
        provider: FactProvider = _installed(self.facts, name, "live_fact", "the live fact")
        return provider

    def _retriever(self, name: str) -> Retriever:
        retriever: Retriever = _installed(self.retrievers, name, "knowledge", "the retriever")
        return retriever


def _installed(providers: Mapping[str, Any], name: str, kind: str, what: str) -> Any:
    """The provider `name`; ContextFailed (`<kind>_unavailable`) when this worker lacks it."""
    provider = providers.get(name)
    if provider is None:
        raise ContextFailed(
            f"{kind}_unavailable",
            f"the agent asks for {what} {name!r}, which this worker does not have "
            f"(installed: {', '.join(sorted(providers)) or 'none'})",
        )
    return provider


class _Job:
    """One provider's work for an attempt."""

    def __init__(self, kind: str, provider: FactProvider | Retriever, work: Awaitable[Any]) -> None:
        self.kind = kind
        self.name = provider.name
        self.required = provider.required
        self.deadline_s = provider.deadline_s
        self.work = work


async def _within(deadline_s: float, work: Awaitable[T]) -> T:
    async with asyncio.timeout(deadline_s):
        return await work


def _fact_value(value: Any) -> str:
    """A fact as one line of at most MAX_FACT_CHARS."""
    if not isinstance(value, str):
        return ""
    line = " ".join(value.split())
    return line[:MAX_FACT_CHARS]


def _words(kind: str) -> str:
    return "live fact" if kind == "live_fact" else "retriever"


def _by_name(providers: Sequence[Any], what: str) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for provider in providers:
        if provider.name in found:
            raise ValueError(f"two {what}s are named {provider.name!r}")
        found[provider.name] = provider
    return found


def _load(obj: Any, name: str, settings: Mapping[str, str], kind: type[Any]) -> Any:
    """The provider an entry point names: itself, or what its factory (a class or a function
    of the settings) makes."""
    factory = isinstance(obj, type) or (callable(obj) and not isinstance(obj, kind))
    provider = obj(settings) if factory else obj
    if isinstance(provider, type) or not isinstance(provider, kind):
        raise TypeError(f"entry point {name!r} is not a {kind.__name__} nor a factory of one")
    return provider
