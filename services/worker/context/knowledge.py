"""The built-in retriever (entry point `tether.retrievers` `documents`): the tenant's documents
in Tether's own store, searched by the orchestrator (PostgreSQL full-text search) for the run
the worker holds, so it sees only that run's tenant's documents. A tenant with no documents costs
no call. Optional: a store that cannot answer leaves the run to answer without knowledge, with a
warning."""

from __future__ import annotations

from collections.abc import Sequence

from services.worker.context.builder import Document
from services.worker.context.providers import KnowledgePort, RetrievalRequest
from services.worker.orchestrator_client import Orchestrator
from tether.domain import Lease


class DocumentsRetriever:
    """Tether's document store, through the orchestrator."""

    name = "documents"
    required = False
    deadline_s = 2.0

    async def retrieve(
        self, request: RetrievalRequest, knowledge: KnowledgePort
    ) -> Sequence[Document]:
        """The best matches of the run's new message."""
        if not request.has_documents or not request.query.strip():
            return []
        return await knowledge.search(
            request.query, limit=request.limit, max_chars=request.max_chars
        )


class LeasedKnowledge:
    """The document search for one run, fenced by its lease (implements KnowledgePort)."""

    def __init__(self, orchestrator: Orchestrator, lease: Lease) -> None:
        self._orchestrator = orchestrator
        self._lease = lease

    async def search(self, query: str, *, limit: int, max_chars: int) -> list[Document]:
        """The matches, best first."""
        return await self._orchestrator.retrieve_knowledge(
            self._lease, query, limit=limit, max_chars=max_chars
        )


documents = DocumentsRetriever()
