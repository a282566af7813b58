"""Re-sealing against the real PostgreSQL: with a new key listed first, every value an older
listed key sealed (named secrets, channel connections and their previous secret, connection
tokens) is sealed again under the new key and opens with it alone; a value under a key no longer
listed is left as it is and counted."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from services.interactions import repository as repo
from services.interactions.channel_store import ChannelSpec, ChannelStore
from services.interactions.connections import REFRESH_PURPOSE
from services.interactions.resealing import SEALED, Resealer
from services.interactions.sealing import Keyring, Sealed
from services.interactions.secret_store import ConnectionTokens, SecretStore
from tether.targets import TargetPolicy

pytestmark = pytest.mark.asyncio(loop_scope="session")

OLD = Keyring.generate_setting("old1")
NEW = Keyring.generate_setting("new1")
SIGNING, BOT, ROTATED = b"signing-secret-1234", b"xoxb-bot-5678", b"signing-secret-rotated-9"


async def _seal_under_old(engine: AsyncEngine, tenant: str) -> str:
    old = Keyring.parse(OLD)
    await SecretStore(engine, old).add(tenant, "alice", "api-token", b"value-4321")
    channels = ChannelStore(engine, old, TargetPolicy.parse(""))
    added = await channels.add(
        tenant,
        "alice",
        ChannelSpec(
            kind="slack",
            name=f"support-{tenant}",
            secrets={"signing_secret": SIGNING, "bot_token": BOT},
        ),
    )
    await channels.rotate(tenant, added.channel_id, ROTATED, timedelta(hours=1))
    async with engine.begin() as conn:
        await repo.upsert_connection(
            conn,
            tenant_id=tenant,
            principal_id="alice",
            provider="google",
            scopes=["calendar"],
            token=ConnectionTokens(old).seal(tenant, "alice", "google", "ya29.token"),
            expires_at=datetime.now(UTC) + timedelta(hours=1),
            refresh=ConnectionTokens(old).seal(
                tenant, "alice", "google" + REFRESH_PURPOSE, "refresh-1"
            ),
        )
    return added.channel_id


async def _key_ids(engine: AsyncEngine, tenant: str) -> set[str]:
    found: set[str] = set()
    async with engine.connect() as conn:
        for sealed in SEALED:
            rows = await conn.execute(
                select(sealed.key_id).where(
                    sealed.table.c.tenant_id == tenant, sealed.key_id.is_not(None)
                )
            )
            found.update(r[0] for r in rows)
    return found


async def test_a_new_key_listed_first_reseals_everything_the_old_one_sealed(
    engine: AsyncEngine,
) -> None:
    channel_id = await _seal_under_old(engine, "t-reseal")
    assert await _key_ids(engine, "t-reseal") == {"old1"}
    both = Keyring.parse(f"{NEW},{OLD}")
    done = await Resealer(engine, both).reseal()
    assert done.resealed >= 4 and done.unopenable == 0
    assert await _key_ids(engine, "t-reseal") == {"new1"}
    assert (await Resealer(engine, both).reseal()).resealed == 0  # nothing left to move

    # The old key can now be dropped: everything opens under the new one alone.
    new = Keyring.parse(NEW)
    assert await SecretStore(engine, new).reveal("t-reseal", "api-token") == b"value-4321"
    verification = await ChannelStore(engine, new, TargetPolicy.parse("")).verification(channel_id)
    assert verification.secrets == (ROTATED, SIGNING)
    async with engine.connect() as conn:
        row = await repo.find_connection(conn, "t-reseal", "alice", "google")
    assert row is not None
    token = Sealed(row.token_ciphertext, row.token_nonce, row.token_key_id)
    assert ConnectionTokens(new).open("t-reseal", "alice", "google", token) == "ya29.token"
    refresh = Sealed(row.refresh_ciphertext, row.refresh_nonce, row.refresh_key_id)
    opened = ConnectionTokens(new).open("t-reseal", "alice", "google" + REFRESH_PURPOSE, refresh)
    assert opened == "refresh-1"


async def test_values_under_a_key_no_longer_listed_are_left_and_counted(
    engine: AsyncEngine,
) -> None:
    await _seal_under_old(engine, "t-retired")
    done = await Resealer(engine, Keyring.parse(NEW)).reseal()
    assert done.resealed == 0 and done.unopenable >= 4
    assert await _key_ids(engine, "t-retired") == {"old1"}


async def test_a_full_batch_asks_for_another_round_at_once(engine: AsyncEngine) -> None:
    await _seal_under_old(engine, "t-batch")
    resealer = Resealer(engine, Keyring.parse(f"{NEW},{OLD}"), batch=1)
    assert await resealer.round() == 0.0
    while await resealer.round() == 0.0:
        pass
    assert await _key_ids(engine, "t-batch") == {"new1"}


async def test_the_log_says_when_the_older_keys_may_be_dropped(
    engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    await _seal_under_old(engine, "t-log")
    resealer = Resealer(engine, Keyring.parse(f"{NEW},{OLD}"))
    with caplog.at_level(logging.INFO, logger="services.interactions.resealing"):
        await resealer.reseal()
        assert "may drop" not in caplog.text
        while (await resealer.reseal()).resealed:
            pass
    assert "nothing is sealed under keys ['old1'] any more" in caplog.text
