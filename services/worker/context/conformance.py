"""The conformance suite every live-fact provider and retriever must pass, built-in or plugged
in. A plugin's own tests call these with its provider (and, for a retriever, a store seeded for
two tenants); Tether's run them against its built-in ones (tests/unit/test_context_providers.py,
tests/integration/test_knowledge_retriever.py). Each raises NotConformant saying what is wrong.

What it holds a provider to: it declares a name (an identifier), whether it is required, and a
deadline (0 < d <= MAX_DEADLINE_S); it answers within that deadline; a live fact is one line of
at most MAX_FACT_CHARS (or None: nothing to say) and the same for the same request and clock; a
retriever returns at most the documents asked for, each cut to the length asked for, each with
an id and a title, never another tenant's, and nothing for a query of no words; and neither
swallows a cancellation (the attempt's deadline and a caller's cancel stop it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from services.worker.context.providers import (
    MAX_FACT_CHARS,
    FactProvider,
    FactRequest,
    KnowledgePort,
    RetrievalRequest,
    Retriever,
)
from tether.ids import is_identifier

MAX_DEADLINE_S = 10.0

SAMPLE_FACTS = FactRequest(
    tenant_id="tenant-conformance",
    run_id="run_conformance",
    source="messaging",
    channel="whatsapp",
    actor_type="guest",
    actor_id="guest-conformance",
    timezone="Europe/Paris",
    now=datetime(2026, 12, 1, 13, 3, 30, tzinfo=UTC),
)


class NotConformant(AssertionError):
    """A provider breaks the contract every implementation keeps."""


def _expect(holds: bool, what: str) -> None:
    if not holds:
        raise NotConformant(what)


def _declares(provider: Any) -> None:
    name = getattr(provider, "name", None)
    _expect(isinstance(name, str) and is_identifier(name), f"name must be an identifier: {name!r}")
    _expect(isinstance(getattr(provider, "required", None), bool), f"{name}: required is a bool")
    deadline = getattr(provider, "deadline_s", None)
    _expect(
        isinstance(deadline, int | float) and 0 < deadline <= MAX_DEADLINE_S,
        f"{name}: deadline_s must be in (0, {MAX_DEADLINE_S}]; got {deadline!r}",
    )


async def _in_time(provider: Any, work: Awaitable[Any]) -> Any:
    try:
        async with asyncio.timeout(provider.deadline_s):
            return await work
    except TimeoutError:
        raise NotConformant(
            f"{provider.name}: no answer within its deadline of {provider.deadline_s} s"
        ) from None


async def _cancellable(provider: Any, work: Awaitable[Any]) -> None:
    """A cancel while it works ends it with CancelledError (or it had finished already)."""
    task = asyncio.ensure_future(work)
    await asyncio.sleep(0)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return
    _expect(task.done() and not task.cancelled(), f"{provider.name}: swallowed a cancellation")


async def check_fact_provider(provider: FactProvider, request: FactRequest = SAMPLE_FACTS) -> None:
    """Hold a live-fact provider to the contract."""
    _expect(isinstance(provider, FactProvider), "not a FactProvider (name, required, fact)")
    _declares(provider)
    value = await _in_time(provider, provider.fact(request))
    _expect(value is None or isinstance(value, str), f"{provider.name}: a str or None")
    if value is not None:
        _expect(bool(value.strip()), f"{provider.name}: say None rather than an empty value")
        _expect("\n" not in value, f"{provider.name}: a fact is one line")
        _expect(len(value) <= MAX_FACT_CHARS, f"{provider.name}: at most {MAX_FACT_CHARS} chars")
    again = await _in_time(provider, provider.fact(request))
    _expect(again == value, f"{provider.name}: the same request and clock, the same value")
    other = replace(request, tenant_id="another-tenant", run_id="run_other")
    await _in_time(provider, provider.fact(other))
    await _cancellable(provider, provider.fact(request))


async def check_retriever(
    retriever: Retriever,
    knowledge: KnowledgePort,
    *,
    tenant_id: str,
    run_id: str,
    matching: str,
    foreign_marker: str,
) -> None:
    """Hold a retriever to the contract. `knowledge` searches for run `run_id` of `tenant_id`;
    the store holds documents of that tenant matching the query `matching`, and documents of
    another tenant that match it too and carry `foreign_marker`."""
    _expect(isinstance(retriever, Retriever), "not a Retriever (name, required, retrieve)")
    _declares(retriever)
    request = RetrievalRequest(tenant_id, run_id, matching, 2, 40, has_documents=True)
    found = list(await _in_time(retriever, retriever.retrieve(request, knowledge)))
    _expect(0 < len(found) <= 2, f"{retriever.name}: 1-2 documents asked, {len(found)} given")
    for document in found:
        _expect(bool(document.document_id and document.title), "each has an id and a title")
        _expect(len(document.text) <= 40, f"{retriever.name}: text cut to max_chars")
        shown = f"{document.title} {document.text}"
        _expect(foreign_marker not in shown, f"{retriever.name}: returned another tenant's")
    wide = replace(request, limit=20, max_chars=64_000)
    for document in await _in_time(retriever, retriever.retrieve(wide, knowledge)):
        shown = f"{document.title} {document.text}"
        _expect(foreign_marker not in shown, f"{retriever.name}: returned another tenant's")
    empty = replace(request, query=" ?! ")
    _expect(
        list(await _in_time(retriever, retriever.retrieve(empty, knowledge))) == [],
        f"{retriever.name}: a query of no words finds nothing",
    )
    await _cancellable(retriever, retriever.retrieve(request, knowledge))
