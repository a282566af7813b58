"""Live facts and retrievers: the built-in ones pass the conformance suite, and `gather` runs an
agent's providers under their deadlines, failing the run for a required one that fails and
recording a warning for an optional one, with nothing left running."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace

import pytest

from services.worker.context import facts
from services.worker.context.builder import Document, Fact
from services.worker.context.conformance import (
    SAMPLE_FACTS,
    NotConformant,
    check_fact_provider,
)
from services.worker.context.providers import (
    ContextFailed,
    ContextProviders,
    FactRequest,
    RetrievalRequest,
)
from tether.domain import ContextPolicy


@pytest.mark.parametrize("provider", [facts.channel, facts.actor, facts.time])
async def test_every_builtin_fact_provider_conforms(provider: object) -> None:
    await check_fact_provider(provider)  # type: ignore[arg-type]


def test_the_builtin_facts_are_what_the_lease_carries() -> None:
    async def values() -> list[str | None]:
        return [await p.fact(SAMPLE_FACTS) for p in (facts.channel, facts.actor, facts.time)]

    assert asyncio.run(values()) == [
        "whatsapp (messaging)",
        "guest-conformance (guest)",
        "2026-12-01 14:03 Tuesday, Europe/Paris (UTC+01:00)",
    ]


class Provider:
    """A provider for the tests: says `value` after `delay_s`, or raises `error`."""

    def __init__(
        self,
        name: str,
        *,
        required: bool,
        value: str = "v",
        delay_s: float = 0.0,
        error: Exception | None = None,
        deadline_s: float = 0.2,
    ) -> None:
        self.name, self.required, self.deadline_s = name, required, deadline_s
        self.value, self.delay_s, self.error = value, delay_s, error
        self.running = 0
        self.cancelled = 0

    async def fact(self, request: FactRequest) -> str | None:
        self.running += 1
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1
        if self.error is not None:
            raise self.error
        return self.value


class Retriever:
    name, required, deadline_s = "docs", False, 0.5

    def __init__(self) -> None:
        self.asked: list[RetrievalRequest] = []

    async def retrieve(self, request: RetrievalRequest, knowledge: object) -> Sequence[Document]:
        self.asked.append(request)
        return [Document(f"d{i}", f"t{i}", "x") for i in range(5)]


RETRIEVAL = RetrievalRequest("t", "run_1", "refunds?", 3, 100, has_documents=True)


async def gather(
    providers: Sequence[Provider], names: Sequence[str], retriever: Retriever | None = None
) -> object:
    policy = ContextPolicy(live_facts=tuple(names), retriever="docs" if retriever else "")
    registry = ContextProviders(providers, [retriever] if retriever else [])
    return await registry.gather(policy, SAMPLE_FACTS, RETRIEVAL, knowledge=None)  # type: ignore[arg-type]


async def test_facts_come_in_the_policy_order_with_the_retrieved_documents() -> None:
    a, b = Provider("a", required=True, value="one"), Provider("b", required=False, value="two")
    retriever = Retriever()
    gathered = await gather([a, b], ["b", "a"], retriever)
    assert gathered.facts == (Fact("b", "two"), Fact("a", "one"))  # type: ignore[attr-defined]
    assert [d.document_id for d in gathered.documents] == ["d0", "d1", "d2"]  # type: ignore[attr-defined]
    assert gathered.warnings == ()  # type: ignore[attr-defined]
    assert retriever.asked == [RETRIEVAL]


async def test_a_required_provider_that_fails_fails_the_run_and_stops_the_others() -> None:
    broken = Provider("zone", required=True, error=RuntimeError("no zone database"))
    slow = Provider("slow", required=False, delay_s=0.15)
    with pytest.raises(ContextFailed) as failed:
        await gather([broken, slow], ["zone", "slow"])
    assert failed.value.code == "live_fact_failed"
    assert "'zone' failed: RuntimeError: no zone database" in failed.value.message
    assert slow.running == 0, "nothing is left running"


async def test_a_required_provider_past_its_deadline_fails_the_run() -> None:
    stuck = Provider("clock", required=True, delay_s=5.0, deadline_s=0.05)
    with pytest.raises(ContextFailed) as failed:
        await gather([stuck], ["clock"])
    assert failed.value.code == "live_fact_timed_out"
    assert "missed its deadline of 0.05 s" in failed.value.message
    assert (stuck.running, stuck.cancelled) == (0, 1)


async def test_an_optional_provider_that_fails_is_left_out_with_a_warning() -> None:
    ok = Provider("channel", required=True, value="chat")
    flaky = Provider("crm", required=False, delay_s=5.0, deadline_s=0.05)
    gathered = await gather([ok, flaky], ["channel", "crm"])
    assert gathered.facts == (Fact("channel", "chat"),)  # type: ignore[attr-defined]
    assert gathered.warnings == ("live_fact_omitted:crm",)  # type: ignore[attr-defined]


async def test_a_provider_this_worker_lacks_fails_the_run_before_any_runs() -> None:
    present = Provider("channel", required=True)
    with pytest.raises(ContextFailed) as failed:
        await gather([present], ["channel", "weather"])
    assert failed.value.code == "live_fact_unavailable"
    assert present.running == 0


async def test_a_fact_is_one_line_of_bounded_length() -> None:
    long = Provider("note", required=False, value="a\nb " + "x" * 900)
    gathered = await gather([long], ["note"])
    [fact] = gathered.facts  # type: ignore[attr-defined]
    assert "\n" not in fact.value and len(fact.value) == 500


async def test_the_suite_refuses_a_provider_that_breaks_the_contract() -> None:
    with pytest.raises(NotConformant, match="one line"):
        await check_fact_provider(Provider("multi", required=False, value="a\nb"))  # type: ignore[arg-type]
    with pytest.raises(NotConformant, match="deadline"):
        await check_fact_provider(  # type: ignore[arg-type]
            Provider("slow", required=False, delay_s=1.0, deadline_s=0.05)
        )
    with pytest.raises(NotConformant, match="identifier"):
        await check_fact_provider(Provider("two words", required=False))  # type: ignore[arg-type]


def test_the_time_follows_the_tenants_zone() -> None:
    tokyo = replace(SAMPLE_FACTS, timezone="Asia/Tokyo")
    assert asyncio.run(facts.time.fact(tokyo)) == "2026-12-01 22:03 Tuesday, Asia/Tokyo (UTC+09:00)"
