"""Re-sealing under the current key: once `TETHER_SECRETS_KEY` lists a new key first, every value
sealed under an older key still listed is opened and sealed again under the new one, a batch at a
time, so the old key can be dropped from the setting once nothing names it.

Each kind of sealed value says where it lives (its table, key columns and sealed columns) and
what it is bound to (its associated data, as the code that sealed it built it). A row is
re-sealed under its row lock and only if it still names the key it was read under, so a
rotation or a re-seal on another replica in between is never undone. A value under a key the
setting no longer lists cannot be opened: it is left as it is, counted and logged, and the
features that use it say `secrets_key_retired`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Column, Table, and_, func, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from services.interactions.connections import PKCE_PURPOSE, REFRESH_PURPOSE
from services.interactions.sealing import Keyring, Sealed, associated_data
from tether.db.schema import channel_connections, connections, interactions, secrets

log = logging.getLogger(__name__)

RESEAL_BATCH = 200


@dataclass(frozen=True)
class SealedColumns:
    """One kind of sealed value: its table, the columns naming its row, its sealed columns and
    the associated data its sealer bound it to (from the row)."""

    what: str
    table: Table
    keys: tuple[Column[Any], ...]
    ciphertext: Column[Any]
    nonce: Column[Any]
    key_id: Column[Any]
    aad: Callable[[Any], bytes]


SEALED: Sequence[SealedColumns] = (
    SealedColumns(
        "secret",
        secrets,
        (secrets.c.tenant_id, secrets.c.name),
        secrets.c.ciphertext,
        secrets.c.nonce,
        secrets.c.key_id,
        lambda r: associated_data(r.tenant_id, "secret", r.name),
    ),
    SealedColumns(
        "channel connection",
        channel_connections,
        (channel_connections.c.tenant_id, channel_connections.c.channel_id),
        channel_connections.c.ciphertext,
        channel_connections.c.nonce,
        channel_connections.c.key_id,
        lambda r: associated_data(r.tenant_id, "channel", r.channel_id),
    ),
    SealedColumns(
        "channel connection's previous secret",
        channel_connections,
        (channel_connections.c.tenant_id, channel_connections.c.channel_id),
        channel_connections.c.previous_ciphertext,
        channel_connections.c.previous_nonce,
        channel_connections.c.previous_key_id,
        lambda r: associated_data(r.tenant_id, "channel-previous", r.channel_id),
    ),
    SealedColumns(
        "connection token",
        connections,
        (connections.c.tenant_id, connections.c.principal_id, connections.c.provider),
        connections.c.token_ciphertext,
        connections.c.token_nonce,
        connections.c.token_key_id,
        lambda r: associated_data(r.tenant_id, "connection", f"{r.principal_id}\n{r.provider}"),
    ),
    SealedColumns(
        "connection refresh token",
        connections,
        (connections.c.tenant_id, connections.c.principal_id, connections.c.provider),
        connections.c.refresh_ciphertext,
        connections.c.refresh_nonce,
        connections.c.refresh_key_id,
        lambda r: associated_data(
            r.tenant_id, "connection", f"{r.principal_id}\n{r.provider}{REFRESH_PURPOSE}"
        ),
    ),
    SealedColumns(
        "pending consent's PKCE verifier",
        interactions,
        (
            interactions.c.interaction_id,
            interactions.c.tenant_id,
            interactions.c.principal_id,
            interactions.c.provider,
        ),
        interactions.c.verifier_ciphertext,
        interactions.c.verifier_nonce,
        interactions.c.verifier_key_id,
        lambda r: associated_data(
            r.tenant_id, "connection", f"{r.principal_id}\n{r.provider}{PKCE_PURPOSE}"
        ),
    ),
)


@dataclass(frozen=True)
class Resealed:
    """What one pass did: values sealed again, and values under keys no longer listed."""

    resealed: int
    unopenable: int


class Resealer:
    """Seals again, under the keyring's sealing key, what older keys it lists sealed."""

    def __init__(self, engine: AsyncEngine, keyring: Keyring, *, batch: int = RESEAL_BATCH):
        self._engine = engine
        self._keyring = keyring
        self._batch = batch
        self._warned: set[tuple[str, str]] = set()
        self._said_done = False

    async def round(self) -> float | None:
        """One pass; 0 when a batch was full (more may wait), else None (nothing known due)."""
        done = await self.reseal()
        return 0.0 if done.resealed >= self._batch else None

    async def reseal(self) -> Resealed:
        """Re-seal up to a batch of each kind of sealed value; what it did."""
        current = self._keyring.sealing_key_id
        if current is None:
            return Resealed(0, 0)
        resealed = unopenable = 0
        for sealed in SEALED:
            moved, stuck = await self._reseal(sealed, current)
            resealed += moved
            unopenable += stuck
        if resealed:
            log.info("re-sealed %d secrets under key %r", resealed, current)
            self._said_done = False
        older = sorted(self._keyring.key_ids - {current})
        if not resealed and older and not self._said_done:
            self._said_done = True
            log.info(
                "nothing is sealed under keys %s any more: TETHER_SECRETS_KEY may drop them",
                older,
            )
        return Resealed(resealed, unopenable)

    async def _reseal(self, sealed: SealedColumns, current: str) -> tuple[int, int]:
        listed = sorted(self._keyring.key_ids - {current})
        async with self._engine.begin() as conn:
            stuck_rows = (
                await conn.execute(
                    select(sealed.key_id, func.count())
                    .where(sealed.key_id.is_not(None), sealed.key_id.not_in([current, *listed]))
                    .group_by(sealed.key_id)
                )
            ).all()
            stuck = sum(count for _, count in stuck_rows)
            for key_id, _ in stuck_rows:
                if (sealed.what, key_id) not in self._warned:
                    self._warned.add((sealed.what, key_id))
                    log.warning(
                        "a %s is sealed under key %r, which TETHER_SECRETS_KEY no longer lists: "
                        "it cannot be opened until that key is listed again",
                        sealed.what,
                        key_id,
                    )
            if not listed:
                return 0, stuck
            rows = (
                await conn.execute(
                    select(*sealed.keys, sealed.ciphertext, sealed.nonce, sealed.key_id)
                    .where(sealed.key_id.in_(listed))
                    .limit(self._batch)
                    .with_for_update(skip_locked=True)
                )
            ).all()
            for row in rows:
                mapping = row._mapping
                old = Sealed(
                    mapping[sealed.ciphertext], mapping[sealed.nonce], mapping[sealed.key_id]
                )
                aad = sealed.aad(row)
                new = self._keyring.seal(self._keyring.open(old, aad), aad)
                await conn.execute(
                    update(sealed.table)
                    .where(
                        and_(*(k == mapping[k] for k in sealed.keys)),
                        sealed.key_id == old.key_id,
                    )
                    .values(
                        {
                            sealed.ciphertext: new.ciphertext,
                            sealed.nonce: new.nonce,
                            sealed.key_id: new.key_id,
                        }
                    )
                )
        return len(rows), stuck
