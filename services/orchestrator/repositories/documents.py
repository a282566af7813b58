"""A tenant's knowledge documents: stored, listed, removed, and searched (PostgreSQL full-text
search, the `english` configuration) for the runs of that tenant alone."""

from __future__ import annotations

import re
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
    literal,
    literal_column,
    or_,
    select,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncConnection

from services.orchestrator.repositories.runs import decode_page_token, encode_page_token
from services.orchestrator.repositories.transitions import LEASE_HELD
from tether.db.schema import documents, runs
from tether.domain import Document
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
) -> Document:
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
    return Document.from_row(row._mapping)


async def page(
    conn: AsyncConnection, tenant_id: str, *, page_size: int, page_token: str
) -> tuple[list[Document], str]:
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
    found = [
        Document.from_row(row._mapping) for row in await conn.execute(stmt.limit(page_size + 1))
    ]
    if len(found) <= page_size:
        return found, ""
    last = found[page_size - 1]
    return found[:page_size], encode_page_token(last.created_at, last.document_id)


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


_TENANT_DOCUMENTS = (
    select(documents.c.document_id)
    .where(documents.c.tenant_id == bindparam("dt_tenant_id", type_=Text))
    .limit(bindparam("dt_batch", type_=Integer))
    .scalar_subquery()
)
_DELETE_TENANT_DOCUMENTS = (
    delete(documents)
    .where(documents.c.document_id.in_(_TENANT_DOCUMENTS))
    .returning(documents.c.document_id)
)


async def remove_tenant_documents(conn: AsyncConnection, tenant_id: str, batch: int) -> int:
    """Remove up to `batch` of a deleted tenant's documents; how many were removed."""
    params = {"dt_tenant_id": tenant_id, "dt_batch": batch}
    return len((await conn.execute(_DELETE_TENANT_DOCUMENTS, params)).all())


async def tenant_has_documents(conn: AsyncConnection, tenant_id: str) -> bool:
    """Whether any document of the tenant is left."""
    found = select(documents.c.document_id).where(documents.c.tenant_id == tenant_id).exists()
    return bool((await conn.execute(select(found))).scalar())


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


_ENGLISH: Any = literal_column("'english'::regconfig")
# A word found in this many of the tenant's documents (or more) says little about which of them
# bear on the query, and ranking every document it matches is what a search costs: it is left
# out of the ranking, unless every word of the query is as common.
COMMON_DOCUMENTS = 50
_QUERY_WORD = (
    func.unnest(bindparam("k_words", type_=ARRAY(Text)))
    .table_valued("word")
    .render_derived("query_word", with_types=False)
)
_WITH_WORD = (
    select(literal(1))
    .select_from(documents)
    .where(
        # Written so that no index on tenant_id serves it: the search's GIN index must, or a
        # generic plan (a prepared statement's, from its sixth run on) filters every document
        # of the tenant by each word, ten times slower with a thousand of them.
        func.concat(documents.c.tenant_id, "") == runs.c.tenant_id,
        documents.c.search.op("@@")(func.to_tsquery(_ENGLISH, _QUERY_WORD.c.word)),
    )
    .correlate(runs, _QUERY_WORD)
    .limit(bindparam("k_common", type_=Integer))
    .subquery("with_word")
)
# The leased run's tenant, only while the lease is held (a stale worker finds no row), and how
# many of its documents hold each word of the query, counting to COMMON_DOCUMENTS at most.
_FENCED_WORDS = (
    select(
        runs.c.tenant_id,
        _QUERY_WORD.c.word,
        select(func.count()).select_from(_WITH_WORD).scalar_subquery().label("found_in"),
    )
    .select_from(runs.outerjoin(_QUERY_WORD, literal_column("true")))
    .where(runs.c.run_id == bindparam("k_run_id", type_=Text), LEASE_HELD)
)
# How many of a named tenant's documents hold each word of the query (as _FENCED_WORDS counts).
_TENANT_WITH_WORD = (
    select(literal(1))
    .select_from(documents)
    .where(
        func.concat(documents.c.tenant_id, "") == bindparam("k_tenant_id", type_=Text),
        documents.c.search.op("@@")(func.to_tsquery(_ENGLISH, _QUERY_WORD.c.word)),
    )
    .correlate(_QUERY_WORD)
    .limit(bindparam("k_common", type_=Integer))
    .subquery("with_word")
)
_TENANT_WORDS = select(
    _QUERY_WORD.c.word,
    select(func.count()).select_from(_TENANT_WITH_WORD).scalar_subquery().label("found_in"),
).select_from(_QUERY_WORD)
_QUERY = func.to_tsquery(_ENGLISH, bindparam("k_query", type_=Text))
_SEARCH = (
    select(
        documents.c.document_id,
        documents.c.title,
        func.left(documents.c.content, bindparam("k_chars", type_=Integer)).label("text"),
        func.ts_rank_cd(documents.c.search, _QUERY).label("rank"),
    )
    .where(
        # Served by the search's GIN index, never the tenant's (see _WITH_WORD).
        func.concat(documents.c.tenant_id, "") == bindparam("k_tenant_id", type_=Text),
        documents.c.search.op("@@")(_QUERY),
    )
    .order_by(desc("rank"), documents.c.document_id)
    .limit(bindparam("k_limit", type_=Integer))
)


async def search_leased(
    conn: AsyncConnection, run_id: str, epoch: int, query: str, *, limit: int, max_chars: int
) -> list[Match]:
    """The documents of the leased run's tenant that match the words of `query`, best first (at
    most `limit`, each text cut to `max_chars`), ranked by its words that are not common among
    the tenant's documents (all of them when every one is); StaleLease unless `epoch` holds the
    run. Two statements: the fence with how common each word is, then the search."""
    words = query_words(query)
    fenced = (
        await conn.execute(
            _FENCED_WORDS,
            {
                "k_run_id": run_id,
                "held_epoch": epoch,
                "k_words": words,
                "k_common": COMMON_DOCUMENTS,
            },
        )
    ).all()
    if not fenced:
        raise StaleLease(f"lease epoch {epoch} of run {run_id} is not current")
    return await _ranked(conn, fenced[0].tenant_id, fenced, limit=limit, max_chars=max_chars)


async def search_tenant(
    conn: AsyncConnection, tenant_id: str, query: str, *, limit: int, max_chars: int
) -> list[Match]:
    """The documents of `tenant_id` that match the words of `query`, ranked as
    `search_leased` ranks them, for a caller the tenant is already known to (a render of its
    agent, which has no run to fence). Two statements: how common each word is, the search."""
    params = {"k_tenant_id": tenant_id, "k_words": query_words(query), "k_common": COMMON_DOCUMENTS}
    counted = (await conn.execute(_TENANT_WORDS, params)).all()
    return await _ranked(conn, tenant_id, counted, limit=limit, max_chars=max_chars)


async def _ranked(
    conn: AsyncConnection, tenant_id: str, counted: Any, *, limit: int, max_chars: int
) -> list[Match]:
    """The search by the rare words of `counted` (rows of word and found_in), else by all."""
    found = [row for row in counted if row.word is not None and row.found_in]
    rare = [row.word for row in found if row.found_in < COMMON_DOCUMENTS]
    ranked_by = rare or [row.word for row in found]
    if not ranked_by:
        return []
    params = {
        "k_tenant_id": tenant_id,
        "k_query": " | ".join(ranked_by),
        "k_chars": max_chars,
        "k_limit": limit,
    }
    rows = (await conn.execute(_SEARCH, params)).all()
    return [Match(r.document_id, r.title, r.text, float(r.rank)) for r in rows]
