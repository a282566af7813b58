"""Channel connections in interactions' store: sealed at rest, never shown by a read, one
tenant's invisible to another, a rotation's previous secret valid only during its grace, and a
refused spec writes nothing."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from services.interactions import repository as repo
from services.interactions.channel_store import ChannelSpec, ChannelStore
from services.interactions.channels_edge import ChannelRpcs
from services.interactions.sealing import Keyring
from tether.errors import AlreadyExists, InvalidArgument, NotFound
from tether.targets import TargetPolicy
from tether.testing.eventually import eventually
from tether.v1 import interactions_pb2

SIGNING = b"slack-signing-secret-0123456789"
BOT = b"xoxb-bot-token-abcdefghij"
KEYRING = Keyring.parse(Keyring.generate_setting("k1"))


def _store(engine: AsyncEngine, policy: str = "") -> ChannelStore:
    return ChannelStore(engine, KEYRING, TargetPolicy.parse(policy))


def _slack(name: str = "support", **overrides: object) -> ChannelSpec:
    fields: dict[str, object] = {
        "kind": "slack",
        "name": name,
        "secrets": {"signing_secret": SIGNING, "bot_token": BOT},
    }
    fields.update(overrides)
    return ChannelSpec(**fields)  # type: ignore[arg-type]


async def _table_text(engine: AsyncEngine) -> str:
    async with engine.connect() as conn:
        rows = (await conn.execute(text("SELECT c::text FROM channel_connections c"))).all()
    return "\n".join(r[0] for r in rows)


async def test_a_connection_is_sealed_and_no_read_shows_a_secret(engine: AsyncEngine) -> None:
    store = _store(engine)
    added = await store.add("t1", "alice", _slack())
    assert added.channel_id.startswith("ch_")
    assert added.api_base_url == "https://slack.com/api/"
    assert added.secret_hints == {"signing_secret": "6789", "bot_token": "ghij"}
    shown = [added, await store.get("t1", added.channel_id), *await store.list("t1")]
    table = await _table_text(engine)
    for secret in (SIGNING, BOT):
        assert secret.decode() not in repr(shown)
        assert secret.decode() not in table
    verification = await store.verification(added.channel_id)
    assert (verification.tenant_id, verification.kind) == ("t1", "slack")
    assert verification.secrets == (SIGNING,)


async def test_another_tenants_connection_is_not_found_like_an_absent_one(
    engine: AsyncEngine,
) -> None:
    store = _store(engine)
    added = await store.add("t1", "alice", _slack())
    assert await store.list("t2") == []
    for call in (
        store.get("t2", added.channel_id),
        store.remove("t2", added.channel_id),
        store.rotate("t2", added.channel_id, b"new-secret-value", timedelta(hours=1)),
    ):
        with pytest.raises(NotFound, match="no channel"):
            await call
    assert (await store.get("t1", added.channel_id)).name == "support"


async def test_a_rotation_keeps_the_previous_secret_only_during_its_grace(
    engine: AsyncEngine,
) -> None:
    store = _store(engine)
    added = await store.add("t1", "alice", _slack())
    rotated = await store.rotate(
        "t1", added.channel_id, b"rotated-signing-secret-9999", timedelta(hours=1)
    )
    assert rotated.secret_hints["signing_secret"] == "9999"
    assert rotated.secret_hints["bot_token"] == "ghij"
    during = await store.verification(added.channel_id)
    assert during.secrets == (b"rotated-signing-secret-9999", SIGNING)
    await store.rotate(
        "t1", added.channel_id, b"third-secret-value-7777", timedelta(milliseconds=300)
    )

    async def only_the_newest() -> bool:
        secrets = (await store.verification(added.channel_id)).secrets
        return secrets == (b"third-secret-value-7777",)

    assert (await store.verification(added.channel_id)).secrets[0] == b"third-secret-value-7777"
    await eventually(only_the_newest, timeout=5, what="the previous secret to expire")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (_slack(kind="telegram"), "kind must be one of"),
        (_slack(name="bad name"), "name must be"),
        (_slack(name="nul\x00"), "name must be"),
        (_slack(agent="not an agent"), "agent must be"),
        (_slack(secrets={"signing_secret": SIGNING}), "bot_token is required"),
        (_slack(secrets={"signing_secret": b"a\x00b", "bot_token": BOT}), "NUL"),
        (_slack(api_base_url="http://127.0.0.1:9/api/"), "api_base_url"),
        (
            ChannelSpec(
                kind="webhook",
                name="hook",
                secrets={"secret": b"whsec-secret"},
                settings={
                    "text_field": "text",
                    "thread_field": "/thread",
                    "sender_field": "/sender",
                    "event_id_field": "/id",
                },
            ),
            "text_field must be a JSON pointer",
        ),
        (
            ChannelSpec(
                kind="whatsapp",
                name="wa",
                secrets={"app_secret": b"a", "verify_token": b"v", "access_token": b"t"},
            ),
            "phone_number_id is required",
        ),
    ],
)
async def test_a_refused_spec_writes_nothing(
    engine: AsyncEngine, spec: ChannelSpec, message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        await _store(engine).add("t1", "alice", spec)
    assert await _table_text(engine) == ""


async def test_loopback_is_accepted_only_when_the_policy_allows_it(engine: AsyncEngine) -> None:
    spec = _slack(api_base_url="http://127.0.0.1:9/api/")
    added = await _store(engine, "loopback").add("t1", "alice", spec)
    assert added.api_base_url == "http://127.0.0.1:9/api/"


async def test_a_name_is_unique_per_tenant(engine: AsyncEngine) -> None:
    store = _store(engine)
    await store.add("t1", "alice", _slack())
    with pytest.raises(AlreadyExists):
        await store.add("t1", "alice", _slack())
    await store.add("t2", "bob", _slack())


async def test_deleting_a_tenant_removes_its_connections(engine: AsyncEngine) -> None:
    store = _store(engine)
    await store.add("t1", "alice", _slack())
    kept = await store.add("t2", "bob", _slack())
    async with engine.begin() as conn:
        assert await repo.tenant_has_rows(conn, "t1")
        await repo.delete_tenant_rows(conn, "t1", 10)
        assert not await repo.tenant_has_rows(conn, "t1")
    assert await store.list("t1") == []
    assert [c.channel_id for c in await store.list("t2")] == [kept.channel_id]


async def test_a_grace_past_a_week_is_refused_and_changes_nothing(engine: AsyncEngine) -> None:
    store = _store(engine)
    added = await store.add("t1", "alice", _slack())
    with pytest.raises(InvalidArgument, match="grace must be between 0 and 7 days"):
        await store.rotate("t1", added.channel_id, b"new-secret-value", timedelta(days=8))
    assert (await store.verification(added.channel_id)).secrets == (SIGNING,)
    assert (await store.get("t1", added.channel_id)).previous_secret_expires_at is None


async def test_a_grace_too_large_for_a_duration_is_refused_not_an_internal_error(
    engine: AsyncEngine,
) -> None:
    store = _store(engine)
    added = await store.add("t1", "alice", _slack())
    # A rotation never asks the orchestrator anything.
    rpcs = ChannelRpcs(store, None)  # type: ignore[arg-type]
    for grace_ms in (2**64 - 1, 10**17):
        with pytest.raises(InvalidArgument, match="grace must be between 0 and 7 days"):
            await rpcs.RotateChannelSecret(
                interactions_pb2.InteractionsServiceRotateChannelSecretRequest(
                    tenant_id="t1",
                    channel_id=added.channel_id,
                    secret="new-secret-value",
                    grace_ms=grace_ms,
                ),
                None,  # type: ignore[arg-type]
            )
    assert (await store.verification(added.channel_id)).secrets == (SIGNING,)
