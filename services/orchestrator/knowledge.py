"""Knowledge: a tenant's documents, kept for its runs' context. Tenants upload, list and remove
them through the gateway; a worker retrieves, for the run it holds, the documents of that run's
tenant that match its new message (fenced by the lease, so no run ever sees another tenant's).

Limits: a title of 1-200 characters without control characters, a text of 1-64,000 characters
without NUL, and at most 5,000 documents per tenant (RESOURCE_EXHAUSTED past that, storing
nothing). Retrieval returns at most 20 documents, each cut to at most 64,000 characters.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from sqlalchemy.ext.asyncio import AsyncEngine

from services.orchestrator.repositories import documents as documents_repo
from services.orchestrator.repositories.documents import Match
from tether.domain import Document
from tether.errors import InvalidArgument
from tether.limits import DOCUMENT_CHARS, DOCUMENT_TITLE_CHARS

MAX_DOCUMENTS = 5_000
MAX_RETRIEVED = 20
DEFAULT_PAGE = 50
MAX_PAGE = 200
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
_NOT_TEXT = re.compile("[\x00\ud800-\udfff]")


class Knowledge:
    """Documents of tenants, on this replica."""

    def __init__(self, engine: AsyncEngine, *, max_documents: int = MAX_DOCUMENTS) -> None:
        self._engine = engine
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._max_documents = max_documents

    async def add(self, tenant_id: str, principal_id: str, title: str, content: str) -> Document:
        """Store a document; InvalidArgument (storing nothing) for a bad title or text,
        ResourceExhausted when the tenant holds as many as it may."""
        if not title.strip() or len(title) > DOCUMENT_TITLE_CHARS or _CONTROL.search(title):
            raise InvalidArgument(
                f"title must be 1-{DOCUMENT_TITLE_CHARS} characters without control characters",
                details={"field": "title"},
            )
        if not content.strip() or len(content) > DOCUMENT_CHARS or _NOT_TEXT.search(content):
            raise InvalidArgument(
                f"content must be 1-{DOCUMENT_CHARS} characters of text without NUL; got "
                f"{len(content)}",
                details={"field": "content"},
            )
        async with self._engine.begin() as conn:
            return await documents_repo.add(
                conn,
                tenant_id=tenant_id,
                principal_id=principal_id,
                title=title,
                content=content,
                max_documents=self._max_documents,
            )

    async def page(
        self, tenant_id: str, page_size: int, page_token: str
    ) -> tuple[Sequence[Document], str]:
        """One page of the tenant's documents, newest first, and the next page's cursor."""
        if page_size < 0:
            raise InvalidArgument("page_size must not be negative")
        size = min(page_size, MAX_PAGE) if page_size > 0 else DEFAULT_PAGE
        async with self._autocommit.connect() as conn:
            return await documents_repo.page(conn, tenant_id, page_size=size, page_token=page_token)

    async def remove(self, tenant_id: str, document_id: str) -> None:
        """Remove the tenant's document; NotFound when absent or another tenant's."""
        async with self._autocommit.connect() as conn:
            await documents_repo.remove(conn, tenant_id, document_id)

    async def retrieve(
        self, run_id: str, epoch: int, query: str, *, limit: int, max_chars: int
    ) -> list[Match]:
        """The leased run's tenant's documents matching `query`, best first; StaleLease
        unless `epoch` holds the run."""
        if not 0 < limit <= MAX_RETRIEVED or not 0 < max_chars <= DOCUMENT_CHARS:
            raise InvalidArgument(
                f"limit must be 1-{MAX_RETRIEVED} and max_chars 1-{DOCUMENT_CHARS}"
            )
        async with self._autocommit.connect() as conn:
            return await documents_repo.search_leased(
                conn, run_id, epoch, query, limit=limit, max_chars=max_chars
            )

    async def search(
        self, tenant_id: str, query: str, *, limit: int, max_chars: int
    ) -> list[Match]:
        """The tenant's documents matching `query`, best first, within the retrieval limits (a
        render's, which has no lease to fence the search by)."""
        limit, max_chars = min(limit, MAX_RETRIEVED), min(max_chars, DOCUMENT_CHARS)
        if limit <= 0 or max_chars <= 0:
            return []
        async with self._autocommit.connect() as conn:
            return await documents_repo.search_tenant(
                conn, tenant_id, query, limit=limit, max_chars=max_chars
            )
