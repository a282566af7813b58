"""Knowledge against the real PostgreSQL: a tenant's documents are stored within their limits
(a refused one stores nothing), listed and removed by their tenant only, and retrieved for a run
through the orchestrator's real gRPC server on the worker's Work stream, fenced by the lease:
the built-in retriever passes the conformance suite and never sees another tenant's documents."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from services.admission.domain import FreshnessPolicy
from services.admission.service import Admitter
from services.orchestrator.execution import Execution
from services.orchestrator.knowledge import Knowledge
from services.orchestrator.repositories import documents as documents_repo
from services.orchestrator.repositories.documents import COMMON_DOCUMENTS
from services.orchestrator.retention import Retention
from services.orchestrator.service import Runs
from services.orchestrator.servicer import OrchestratorServicer
from services.orchestrator.webhooks import Subscriptions
from services.orchestrator.work import WorkSettings
from services.worker.context.conformance import check_retriever
from services.worker.context.knowledge import LeasedKnowledge, documents
from services.worker.orchestrator_client import Orchestrator
from services.worker.work_stream import Held, WorkStream
from tests.integration.test_admission import _tenant, chat
from tether.db.schema import documents as documents_table
from tether.domain import Assignment, Lease
from tether.errors import InvalidArgument, NotFound, ResourceExhausted, StaleLease
from tether.settings import RetainingSettings
from tether.targets import TargetPolicy
from tether.v1 import orchestrator_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="session")

REFUNDS_A = "Refunds are paid within 30 days of a returned order, to the original card."
REFUNDS_B = "Refunds SECRET-OF-B are never paid: every refund goes to store credit instead."


async def _count(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int(
            (await conn.execute(select(func.count()).select_from(documents_table))).scalar_one()
        )


async def test_documents_keep_their_limits_and_their_tenant(engine: AsyncEngine) -> None:
    knowledge = Knowledge(engine, max_documents=2)
    first = await knowledge.add("t1", "alice", "Refunds", REFUNDS_A)
    assert (first.title, first.chars, first.created_by) == ("Refunds", len(REFUNDS_A), "alice")
    for title, content in [
        ("", "text"),
        ("x" * 201, "text"),
        ("tab\there", "text"),
        ("Empty", "  "),
        ("Big", "x" * 64_001),
        ("Nul", "a\x00b"),
    ]:
        with pytest.raises(InvalidArgument):
            await knowledge.add("t1", "alice", title, content)
    assert await _count(engine) == 1, "a refused document stores nothing"
    await knowledge.add("t1", "alice", "Shipping", "We ship in two days.")
    with pytest.raises(ResourceExhausted) as full:
        await knowledge.add("t1", "alice", "Third", "one too many")
    assert full.value.code == "document_limit_reached"
    assert await _count(engine) == 2
    await knowledge.add("t2", "bob", "Other tenant", REFUNDS_B)  # another tenant has its own

    rows, token = await knowledge.page("t1", 1, "")
    assert [r.title for r in rows] == ["Shipping"] and token
    rows, token = await knowledge.page("t1", 1, token)
    assert [r.title for r in rows] == ["Refunds"] and token == ""
    with pytest.raises(NotFound) as other:
        await knowledge.remove("t2", first.document_id)
    with pytest.raises(NotFound) as absent:
        await knowledge.remove("t1", "doc_absent")
    assert other.value.message.replace(first.document_id, "x") == absent.value.message.replace(
        "doc_absent", "x"
    ), "another tenant's document is answered as an absent one"
    await knowledge.remove("t1", first.document_id)
    assert [r.title for r in (await knowledge.page("t1", 0, ""))[0]] == ["Shipping"]


class Quiet:
    """A Work stream handler that takes no leases (the test claims them itself)."""

    def leased(self, assignment: Assignment) -> None:
        raise AssertionError("no lease is pushed: no credits were granted")

    def cancelled(self, run_id: str, epoch: int) -> None: ...

    def lost(self, run_id: str, epoch: int) -> None: ...

    def held(self) -> Sequence[Held]:
        return []


@contextlib.asynccontextmanager
async def orchestrator(engine: AsyncEngine) -> AsyncIterator[tuple[Execution, Orchestrator]]:
    """The real orchestrator servicer on loopback gRPC, and a worker's client on a Work stream."""
    execution = Execution.build(engine, None, lease_ttl_s=30, claim_poll_s=60)
    servicer = OrchestratorServicer(
        Runs(engine, execution.publisher, None),
        execution,
        WorkSettings(lease_ttl_s=30, keepalive_interval_s=5, progress_deadline_s=60),
        Retention(engine, RetainingSettings()),
        Subscriptions(engine, None, TargetPolicy.parse("")),
    )
    server = grpc.aio.server()
    orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stream = WorkStream(channel, "w-knowledge")
    running = asyncio.ensure_future(stream.run(Quiet()))
    try:
        yield execution, Orchestrator(stream)
    finally:
        await stream.close()
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await running
        await channel.close()
        await server.stop(None)


async def _leased(engine: AsyncEngine, execution: Execution, tenant: str) -> Any:
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    await admitter.admit(chat(f"k-{tenant}", tenant=tenant, conversation=f"c-{tenant}"))
    [claimed] = await execution.claims.claim_many("w-knowledge", 1)
    assert claimed.run.tenant_id == tenant
    assert claimed.has_documents, "the lease says the tenant has documents to retrieve"
    return claimed.run


async def test_the_builtin_retriever_conforms_over_the_work_stream(engine: AsyncEngine) -> None:
    await _tenant(engine, "t1", "t2")
    knowledge = Knowledge(engine)
    await knowledge.add("t1", "alice", "Refund policy", REFUNDS_A)
    await knowledge.add("t1", "alice", "Returns", "A returned order is refunded once inspected.")
    await knowledge.add("t2", "bob", "Refund policy", REFUNDS_B)
    async with orchestrator(engine) as (execution, client):
        run_a = await _leased(engine, execution, "t1")
        lease = Lease(run_a.run_id, run_a.lease_epoch)
        port = LeasedKnowledge(client, lease)
        await check_retriever(
            documents,
            port,
            tenant_id="t1",
            run_id=run_a.run_id,
            matching="how are refunds paid?",
            foreign_marker="SECRET-OF-B",
        )
        found = await port.search("refunds paid", limit=5, max_chars=1000)
        assert found[0].title == "Refund policy"
        assert all("SECRET" not in d.text for d in found)
        # A lease that is no longer current retrieves nothing.
        stale = LeasedKnowledge(client, Lease(run_a.run_id, run_a.lease_epoch + 1))
        with pytest.raises(StaleLease):
            await stale.search("refunds", limit=5, max_chars=100)


async def test_a_tenant_without_documents_is_leased_without_a_retrieval(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "t1")
    execution = Execution.build(engine, None, lease_ttl_s=30, claim_poll_s=60)
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    await admitter.admit(chat("no-docs", conversation="c-none"))
    [claimed] = await execution.claims.claim_many("w", 1)
    assert not claimed.has_documents


async def test_a_word_most_documents_hold_does_not_drown_the_rare_ones(engine: AsyncEngine) -> None:
    await _tenant(engine, "t1")
    knowledge = Knowledge(engine)
    for i in range(COMMON_DOCUMENTS + 10):
        await knowledge.add("t1", "alice", f"Policy {i}", f"The policy number {i} of the archive.")
    rare = await knowledge.add("t1", "alice", "Zebras", "The zebra policy: zebras graze at noon.")
    execution = Execution.build(engine, None, lease_ttl_s=30, claim_poll_s=60)
    run = await _leased(engine, execution, "t1")
    async with engine.connect() as conn:
        found = await documents_repo.search_leased(
            conn, run.run_id, run.lease_epoch, "what is the zebra policy?", limit=3, max_chars=80
        )
        assert [m.document_id for m in found] == [rare.document_id], "ranked by the rare word"
        common = await documents_repo.search_leased(
            conn, run.run_id, run.lease_epoch, "policy", limit=3, max_chars=80
        )
        assert len(common) == 3, "a query of common words only is still answered"
        none = await documents_repo.search_leased(
            conn, run.run_id, run.lease_epoch, "unicorns", limit=3, max_chars=80
        )
        assert none == []
