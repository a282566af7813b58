"""A tenant's knowledge documents: stored, listed, removed, and searched (PostgreSQL full-text
search, the `english` configuration) for the runs of that tenant alone."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    Integer,
    Text,
    and_,
    bindparam,
    delete,
    desc,
    func,
    insert,
    literal_column,
    or_,
    select,
)
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection

from services.orchestrator.repositories.runs import decode_page_token, encode_page_token
from services.orchestrator.repositories.transitions import LEASE_HELD
from tether.db.schema import documents, runs
from tether.errors import NotFound, ResourceExhausted, StaleLease
from tether.ids import new_id

# The columns a list shows (the text stays in the table).
_LISTED = (
    documents.c.document_id,
    documents.c.title,
    func.char_length(documents.c.content).label("chars"),
    documents.c.created_by,
    documents.c.created_at,
)
# The words of a query that reach the search: letters and digits (tsquery's syntax characters
# never do), at most this many.
_WORD = re.compile(r"[^\W_]+")
MAX_QUERY_WORDS = 64


async def add(
    conn: AsyncConnection,
    *,
    tenant_id: str,
    principal_id: str,
    title: str,
    content: str,
    max_documents: int,
) -> Row[Any]:
    """Store a document (its listed columns); ResourceExhausted, storing nothing, when the
    tenant already holds `max_documents`. Run in a transaction: the tenant's adds queue on one
    lock, so two at once cannot both pass the count."""
    lock = func.pg_advisory_xact_lock(func.hashtextextended(f"documents:{tenant_id}", 0))
    await conn.execute(select(lock))
    held = (
        select(func.count()).select_from(documents).where(documents.c.tenant_id == tenant_id)
    ).scalar_subquery()
    row = (
        await conn.execute(
            insert(documents)
            .from_select(
                ["document_id", "tenant_id", "title", "content", "created_by"],
                select(
                    bindparam("d_id", type_=Text),
                    bindparam("d_tenant", type_=Text),
                    bindparam("d_title", type_=Text),
                    bindparam("d_content", type_=Text),
                    bindparam("d_by", type_=Text),
                ).where(held < max_documents),
            )
            .returning(*_LISTED),
            {
                "d_id": new_id("doc"),
                "d_tenant": tenant_id,
                "d_title": title,
                "d_content": content,
                "d_by": principal_id,
            },
        )
    ).first()
    if row is None:
        raise ResourceExhausted(
            f"the tenant holds {max_documents} documents, the most it may; remove some first",
            code="document_limit_reached",
            details={"limit": max_documents},
        )
    return row


async def page(
    conn: AsyncConnection, tenant_id: str, *, page_size: int, page_token: str
) -> tuple[Sequence[Row[Any]], str]:
    """One page of the tenant's documents (listed columns), newest first, and the next page's
    cursor."""
    stmt = select(*_LISTED).where(documents.c.tenant_id == tenant_id)
    if page_token:
        created_at, document_id = decode_page_token(page_token)
        stmt = stmt.where(
            or_(
                documents.c.created_at < created_at,
                and_(documents.c.created_at == created_at, documents.c.document_id < document_id),
            )
        )
    stmt = stmt.order_by(documents.c.created_at.desc(), documents.c.document_id.desc())
    rows = (await conn.execute(stmt.limit(page_size + 1))).all()
    if len(rows) <= page_size:
        return rows, ""
    last = rows[page_size - 1]
    return rows[:page_size], encode_page_token(last.created_at, last.document_id)


async def remove(conn: AsyncConnection, tenant_id: str, document_id: str) -> None:
    """Remove the tenant's document; NotFound when it is absent or another tenant's (the same
    answer)."""
    removed = (
        await conn.execute(
            delete(documents)
            .where(documents.c.document_id == document_id, documents.c.tenant_id == tenant_id)
            .returning(documents.c.document_id)
        )
    ).first()
    if removed is None:
        raise NotFound(f"document {document_id!r} not found")


@dataclass(frozen=True)
class Match:
    """One document that matched a query, its text cut to the asked length."""

    document_id: str
    title: str
    text: str
    rank: float


def query_words(query: str) -> list[str]:
    """The words of `query` the search looks for (any of them matches)."""
    words = dict.fromkeys(w.lower() for w in _WORD.findall(query))
    return list(words)[:MAX_QUERY_WORDS]


_QUERY = func.to_tsquery(literal_column("'english'::regconfig"), bindparam("k_query", type_=Text))
# The leased run's tenant, only while the lease is held: a stale worker finds nothing.
_FENCE = (
    select(runs.c.tenant_id)
    .where(runs.c.run_id == bindparam("k_run_id", type_=Text), LEASE_HELD)
    .cte("fence")
)
_MATCHES = (
    select(
        documents.c.document_id,
        documents.c.title,
        func.left(documents.c.content, bindparam("k_chars", type_=Integer)).label("text"),
        func.ts_rank_cd(documents.c.search, _QUERY).label("rank"),
    )
    .where(documents.c.tenant_id == _FENCE.c.tenant_id, documents.c.search.op("@@")(_QUERY))
    .order_by(desc("rank"), documents.c.document_id)
    .limit(bindparam("k_limit", type_=Integer))
    .lateral("matched")
)
_SEARCH = select(
    _FENCE.c.tenant_id,
    _MATCHES.c.document_id,
    _MATCHES.c.title,
    _MATCHES.c.text,
    _MATCHES.c.rank,
).select_from(_FENCE.outerjoin(_MATCHES, literal_column("true")))


async def search_leased(
    conn: AsyncConnection, run_id: str, epoch: int, query: str, *, limit: int, max_chars: int
) -> list[Match]:
    """The documents of the leased run's tenant that match any word of `query`, best first (at
    most `limit`, each text cut to `max_chars`); StaleLease unless `epoch` holds the run. One
    statement: the fence and the search."""
    words = query_words(query)
    params = {
        "k_run_id": run_id,
        "held_epoch": epoch,
        # No word: the empty query, which matches nothing (the fence is still asked).
        "k_query": " | ".join(words),
        "k_chars": max_chars,
        "k_limit": limit,
    }
    rows = (await conn.execute(_SEARCH, params)).all()
    if not rows:
        raise StaleLease(f"lease epoch {epoch} of run {run_id} is not current")
    return [
        Match(r.document_id, r.title, r.text, float(r.rank))
        for r in rows
        if r.document_id is not None
    ]
