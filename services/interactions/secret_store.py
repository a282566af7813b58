"""The secret store: a tenant's named secrets, sealed at rest, and the connections' OAuth tokens
sealed the same way. No read returns a value: a name, its last four characters and when it was
stored, at most. Adding a name that exists is ALREADY_EXISTS (remove it first): a replace would
let a typo silently swap a credential that a channel already uses."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncEngine

from services.interactions import repository as repo
from services.interactions import secrets_repository as secrets_repo
from services.interactions.sealing import Keyring, Sealed, associated_data
from tether.errors import AlreadyExists, InvalidArgument, NotFound
from tether.ids import is_identifier

# Far above any token or signing secret a provider issues, far below what a row should carry.
MAX_SECRET_BYTES = 64 * 1024
# How many plaintext connection tokens one sealing statement batch reads.
_SEAL_BATCH = 100


@dataclass(frozen=True)
class SecretInfo:
    """What a read shows of a secret."""

    name: str
    last_four: str
    created_at: datetime


def last_four_of(value: bytes) -> str:
    """The last four characters when the value is text, else nothing: a short value shows at
    most half of itself."""
    try:
        text = value.decode()
    except UnicodeDecodeError:
        return ""
    shown = min(4, len(text) // 2)
    return text[-shown:] if shown else ""


class SecretStore:
    """Adds, lists and removes a tenant's named secrets."""

    def __init__(self, engine: AsyncEngine, keyring: Keyring) -> None:
        self._engine = engine
        self._keyring = keyring

    async def add(self, tenant_id: str, principal_id: str, name: str, value: bytes) -> SecretInfo:
        """Seal and store `value` under `name`."""
        if not is_identifier(name):
            raise InvalidArgument("name must be 1..128 of [A-Za-z0-9._:@-], starting alphanumeric")
        if not value:
            raise InvalidArgument("value is empty")
        if len(value) > MAX_SECRET_BYTES:
            raise InvalidArgument(f"value is over {MAX_SECRET_BYTES} bytes")
        sealed = self._keyring.seal(value, associated_data(tenant_id, "secret", name))
        async with self._engine.begin() as conn:
            row = await secrets_repo.insert_secret(
                conn,
                tenant_id=tenant_id,
                name=name,
                sealed=sealed,
                last_four=last_four_of(value),
                created_by=principal_id,
            )
        if row is None:
            raise AlreadyExists(f"a secret named {name!r} exists; remove it first")
        return SecretInfo(row.name, row.last_four, row.created_at)

    async def list(self, tenant_id: str) -> list[SecretInfo]:
        """The tenant's secrets by name."""
        async with self._engine.connect() as conn:
            rows = await secrets_repo.list_secrets(conn, tenant_id)
        return [SecretInfo(r.name, r.last_four, r.created_at) for r in rows]

    async def remove(self, tenant_id: str, name: str) -> None:
        """Remove a secret: absent and another tenant's answer alike."""
        async with self._engine.begin() as conn:
            if not await secrets_repo.delete_secret(conn, tenant_id, name):
                raise NotFound(f"no secret named {name!r}")

    async def reveal(self, tenant_id: str, name: str) -> bytes:
        """A secret's value, for the features inside interactions that use it."""
        async with self._engine.connect() as conn:
            row = await secrets_repo.sealed_secret(conn, tenant_id, name)
        if row is None:
            raise NotFound(f"no secret named {name!r}")
        return self._keyring.open(
            Sealed(row.ciphertext, row.nonce, row.key_id),
            associated_data(tenant_id, "secret", name),
        )


class ConnectionTokens:
    """Seals and opens the OAuth tokens of connections, bound to (tenant, principal, provider)."""

    def __init__(self, keyring: Keyring) -> None:
        self._keyring = keyring

    @staticmethod
    def _aad(tenant_id: str, principal_id: str, provider: str) -> bytes:
        return associated_data(tenant_id, "connection", f"{principal_id}\n{provider}")

    def seal(self, tenant_id: str, principal_id: str, provider: str, token: str) -> Sealed:
        """The token sealed for its connection."""
        return self._keyring.seal(token.encode(), self._aad(tenant_id, principal_id, provider))

    def open(self, tenant_id: str, principal_id: str, provider: str, sealed: Sealed) -> str:
        """The token of a connection sealed by `seal`."""
        return self._keyring.open(sealed, self._aad(tenant_id, principal_id, provider)).decode()

    async def seal_plaintext(self, engine: AsyncEngine) -> int:
        """Seal and clear every plaintext token (rows from before 0023, or the previous
        release's during a rollout); how many were sealed."""
        sealed = 0
        while True:
            async with engine.begin() as conn:
                rows = await repo.plaintext_connections(conn, _SEAL_BATCH)
                for row in rows:
                    token = self.seal(
                        row.tenant_id, row.principal_id, row.provider, row.access_token
                    )
                    sealed += await repo.seal_connection_token(
                        conn, row.tenant_id, row.principal_id, row.provider, row.access_token, token
                    )
            if len(rows) < _SEAL_BATCH:
                return sealed
