"""A connection's OAuth token never stays in the connections table in plaintext: stored sealed,
and a plaintext row (stored before 0023, or by the previous release during a rollout) sealed
and cleared by interactions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import insert, text
from sqlalchemy.ext.asyncio import AsyncEngine

from services.interactions import repository as repo
from services.interactions.sealing import Keyring, Sealed
from services.interactions.secret_store import ConnectionTokens
from tether.db.schema import connections

TOKEN = "ya29.plaintext-token-4242"
TOKENS = ConnectionTokens(Keyring.parse(Keyring.generate_setting("k1")))


async def _table_text(engine: AsyncEngine) -> str:
    async with engine.connect() as conn:
        rows = (await conn.execute(text("SELECT c::text FROM connections c"))).all()
    return "\n".join(r[0] for r in rows)


async def _stored(engine: AsyncEngine, principal_id: str) -> Sealed:
    async with engine.connect() as conn:
        row = await repo.find_connection(conn, "t1", principal_id, "democal")
    assert row is not None
    assert row.access_token == ""
    return Sealed(row.token_ciphertext, row.token_nonce, row.token_key_id)


async def test_a_stored_token_is_not_in_the_table(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await repo.upsert_connection(
            conn,
            tenant_id="t1",
            principal_id="alice",
            provider="democal",
            scopes=["calendar.read"],
            token=TOKENS.seal("t1", "alice", "democal", TOKEN),
            expires_at=datetime.now(UTC) + timedelta(hours=1),
        )
    stored = await _table_text(engine)
    assert "alice" in stored
    assert TOKEN not in stored
    assert TOKENS.open("t1", "alice", "democal", await _stored(engine, "alice")) == TOKEN


async def test_plaintext_rows_are_sealed_and_cleared(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        for principal in ("bob", "carol"):
            await conn.execute(
                insert(connections).values(
                    tenant_id="t1",
                    principal_id=principal,
                    provider="democal",
                    scopes=["calendar.read"],
                    access_token=f"{TOKEN}-{principal}",
                    expires_at=datetime.now(UTC) + timedelta(hours=1),
                )
            )
    assert TOKEN in await _table_text(engine)
    assert await TOKENS.seal_plaintext(engine) == 2
    assert TOKEN not in await _table_text(engine)
    for principal in ("bob", "carol"):
        opened = TOKENS.open("t1", principal, "democal", await _stored(engine, principal))
        assert opened == f"{TOKEN}-{principal}"
    assert await TOKENS.seal_plaintext(engine) == 0
