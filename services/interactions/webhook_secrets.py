"""Run-event webhook subscriptions' signing secrets, sealed at rest. The subscriptions are the
orchestrator's; it alone may seal, open or discard their secrets (tether.credentials.POWERS),
and it keeps an opened one in memory briefly to sign deliveries. No caller's read shows one."""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.interactions.sealing import Keyring, Sealed, associated_data
from tether.db.schema import webhook_secrets
from tether.errors import InvalidArgument, NotFound

# A Standard Webhooks secret is 24 to 64 random bytes, base64 behind "whsec_": far below this.
MAX_WEBHOOK_SECRET_CHARS = 1024
_KIND = "webhook_secret"


async def upsert_secret(
    conn: AsyncConnection, tenant_id: str, subscription_id: str, sealed: Sealed
) -> None:
    """Store (or replace, on a retried call) a subscription's sealed secret."""
    stmt = pg_insert(webhook_secrets).values(
        tenant_id=tenant_id,
        subscription_id=subscription_id,
        ciphertext=sealed.ciphertext,
        nonce=sealed.nonce,
        key_id=sealed.key_id,
    )
    await conn.execute(
        stmt.on_conflict_do_update(
            index_elements=["tenant_id", "subscription_id"],
            set_={
                "ciphertext": stmt.excluded.ciphertext,
                "nonce": stmt.excluded.nonce,
                "key_id": stmt.excluded.key_id,
            },
        )
    )


async def sealed_secret(
    conn: AsyncConnection, tenant_id: str, subscription_id: str
) -> Sealed | None:
    """A subscription's sealed secret; None when none is stored (in that tenant)."""
    row = (
        await conn.execute(
            select(
                webhook_secrets.c.ciphertext, webhook_secrets.c.nonce, webhook_secrets.c.key_id
            ).where(
                webhook_secrets.c.tenant_id == tenant_id,
                webhook_secrets.c.subscription_id == subscription_id,
            )
        )
    ).first()
    return None if row is None else Sealed(row.ciphertext, row.nonce, row.key_id)


async def delete_secret(conn: AsyncConnection, tenant_id: str, subscription_id: str) -> None:
    """Remove a subscription's secret; absent is no error (a retried removal)."""
    await conn.execute(
        delete(webhook_secrets).where(
            webhook_secrets.c.tenant_id == tenant_id,
            webhook_secrets.c.subscription_id == subscription_id,
        )
    )


def _named(tenant_id: str, subscription_id: str) -> bytes:
    if not tenant_id or not subscription_id:
        raise InvalidArgument("tenant_id and subscription_id are required")
    return associated_data(tenant_id, _KIND, subscription_id)


class WebhookSecrets:
    """Seals, opens and discards subscriptions' signing secrets."""

    def __init__(self, engine: AsyncEngine, keyring: Keyring) -> None:
        self._engine = engine
        self._keyring = keyring

    async def seal(self, tenant_id: str, subscription_id: str, secret: str) -> None:
        """Seal and store (or replace) a subscription's secret."""
        aad = _named(tenant_id, subscription_id)
        if not secret or len(secret) > MAX_WEBHOOK_SECRET_CHARS:
            raise InvalidArgument(f"secret must be 1..{MAX_WEBHOOK_SECRET_CHARS} characters")
        sealed = self._keyring.seal(secret.encode(), aad)
        async with self._engine.begin() as conn:
            await upsert_secret(conn, tenant_id, subscription_id, sealed)

    async def open(self, tenant_id: str, subscription_id: str) -> str:
        """A subscription's secret; NotFound when none is stored (in that tenant)."""
        aad = _named(tenant_id, subscription_id)
        async with self._engine.connect() as conn:
            sealed = await sealed_secret(conn, tenant_id, subscription_id)
        if sealed is None:
            raise NotFound(f"no secret for subscription {subscription_id!r}")
        return self._keyring.open(sealed, aad).decode()

    async def discard(self, tenant_id: str, subscription_id: str) -> None:
        """Remove a subscription's secret (absent: nothing to do)."""
        _named(tenant_id, subscription_id)
        async with self._engine.begin() as conn:
            await delete_secret(conn, tenant_id, subscription_id)
