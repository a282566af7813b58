"""Authenticates callers by API key, token or browser session (or the operator credential) and
checks the scope each RPC needs."""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Mapping
from datetime import UTC, datetime

from sqlalchemy.ext.asyncio import AsyncEngine

from services.gateway import browser_credentials
from services.gateway.browser_credentials import SESSION_PREFIX, TOKEN_PREFIX
from tether.apikeys import (
    AGENTS_READ,
    AGENTS_WRITE,
    CHANNELS_READ,
    CHANNELS_WRITE,
    DOCUMENTS_READ,
    DOCUMENTS_WRITE,
    KEY_PREFIX,
    KEYS_ADMIN,
    OPERATOR,
    SCHEDULES_READ,
    SCHEDULES_WRITE,
    SECRETS_READ,
    SECRETS_WRITE,
    WEBHOOKS_READ,
    WEBHOOKS_WRITE,
    Principal,
    find_key,
    operator_in,
    tenant_exists,
)
from tether.errors import InvalidArgument, NotFound, PermissionDenied, Unauthenticated
from tether.ids import is_identifier

# Method name -> scope it requires.
SCOPES: Mapping[str, str] = {
    "SendMessage": "runs:write",
    "SubmitEvent": "runs:write",
    "GetRun": "runs:read",
    "ListRuns": "runs:read",
    "CancelRun": "runs:write",
    "StreamRun": "runs:read",
    "StreamConversation": "runs:read",
    "GetPendingQuestion": "runs:read",
    "AnswerQuestion": "interactions:write",
    "GetPendingApproval": "runs:read",
    "DecideApproval": "approvals:decide",
    "GetPendingConnection": "runs:read",
    "CompleteConnection": "interactions:write",
    "GetRunAttempts": "runs:read",
    "RetryRun": "runs:write",
    "CreateApiKey": KEYS_ADMIN,
    "RevokeApiKey": KEYS_ADMIN,
    "AddDocument": DOCUMENTS_WRITE,
    "ListDocuments": DOCUMENTS_READ,
    "RemoveDocument": DOCUMENTS_WRITE,
    "AddSecret": SECRETS_WRITE,
    "ListSecrets": SECRETS_READ,
    "RemoveSecret": SECRETS_WRITE,
    "AddChannel": CHANNELS_WRITE,
    "ListChannels": CHANNELS_READ,
    "GetChannel": CHANNELS_READ,
    "RemoveChannel": CHANNELS_WRITE,
    "RotateChannelSecret": CHANNELS_WRITE,
    "AddWebhook": WEBHOOKS_WRITE,
    "ListWebhooks": WEBHOOKS_READ,
    "RemoveWebhook": WEBHOOKS_WRITE,
    "ListWebhookDeliveries": WEBHOOKS_READ,
    "RedeliverWebhook": WEBHOOKS_WRITE,
    "AddSchedule": SCHEDULES_WRITE,
    "ListSchedules": SCHEDULES_READ,
    "PauseSchedule": SCHEDULES_WRITE,
    "ResumeSchedule": SCHEDULES_WRITE,
    "RemoveSchedule": SCHEDULES_WRITE,
    "StreamRuns": "runs:read",
    "ApplyAgent": AGENTS_WRITE,
    "GetAgent": AGENTS_READ,
    "ListAgents": AGENTS_READ,
    "ListAgentVersions": AGENTS_READ,
    "RollbackAgent": AGENTS_WRITE,
    "SetDefaultAgent": AGENTS_WRITE,
    "RemoveAgent": AGENTS_WRITE,
    "ListTools": AGENTS_READ,
    "RenderAgent": AGENTS_READ,
}
AGENT_METHODS = frozenset(m for m, scope in SCOPES.items() if scope.startswith("agents:"))
# What the platform operator's credential may call: it manages tenants and keys...
OPERATOR_METHODS = frozenset({"CreateApiKey", "RevokeApiKey", "DeleteTenant", "SetTenant"})
# ...and, within one tenant it names (metadata TENANT_METADATA), reads and retries runs as a
# runs:all key of that tenant would.
# ...and acts on its agents.
OPERATOR_TENANT_METHODS = frozenset(
    {"GetRun", "ListRuns", "GetRunAttempts", "RetryRun", *AGENT_METHODS}
)
TENANT_METADATA = "tether-tenant"


def is_utf8(secret: str) -> bool:
    """Whether `secret` encodes as UTF-8. One with lone surrogates (bytes aiohttp could not
    decode, or a JSON escape) is no credential we issued, and hashing it would raise."""
    try:
        secret.encode()
    except UnicodeEncodeError:
        return False
    return True


class SessionSecret(str):
    """A session cookie's secret as the HTTP bridge passes it on in the `authorization`
    metadata. Only an object of this class made in this process is taken as a session: a
    "Bearer ts_..." a caller sends itself (header or gRPC metadata) is refused, so a session
    is only ever a same-origin cookie checked for CSRF."""

    __slots__ = ()


class Authenticator:
    """Verifies keys against their stored hashes, caching verified keys briefly.

    The cache makes a hot key cost no database round trip; a revoked key stops working within
    `cache_ttl_s` (an expired one at its expiry), and an open stream that re-verifies every
    `recheck_s` ends within their sum.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        cache_ttl_s: float = 4.0,
        recheck_s: float = 1.0,
        operator_sha256: str = "",
    ) -> None:
        self._engine = engine
        self._ttl = cache_ttl_s
        self.recheck_s = recheck_s
        self._operator = bytes.fromhex(operator_sha256) if operator_sha256 else None
        self._cache: dict[str, tuple[float, Principal]] = {}

    async def authenticate(self, metadata: Mapping[str, str | bytes], method: str) -> Principal:
        """The caller's principal, with the scope `method` needs; raises otherwise."""
        header = metadata.get("authorization", "")
        if not isinstance(header, str) or not header.startswith("Bearer "):
            raise Unauthenticated('missing API key: send metadata "authorization: Bearer <key>"')
        secret = header.removeprefix("Bearer ").strip()
        if not is_utf8(secret):
            raise Unauthenticated("the API key is not valid (unknown, revoked or expired)")
        named = metadata.get(TENANT_METADATA, "")
        if not isinstance(named, str):
            raise InvalidArgument(f"the {TENANT_METADATA} metadata must be text")
        if self._is_operator(secret):
            if method in OPERATOR_METHODS:
                return OPERATOR
            if method in OPERATOR_TENANT_METHODS:
                return await self._operator_in(named, method)
            raise PermissionDenied(
                f"the operator credential manages tenants and keys, and reads and retries a "
                f"named tenant's runs; call {method} with a tenant's API key"
            )
        principal = await self._verify(secret, session=isinstance(header, SessionSecret))
        needed = SCOPES.get(method)
        if needed is None and method in OPERATOR_METHODS:
            raise PermissionDenied(f"{method} is the platform operator's alone")
        if needed is None or needed not in principal.scopes:
            raise PermissionDenied(f"this API key lacks the scope {needed!r} that {method} needs")
        if named and named != principal.tenant_id:
            raise PermissionDenied(
                f"the {TENANT_METADATA} metadata names a tenant other than the one your API key "
                "belongs to (only the platform operator names a tenant)"
            )
        return principal

    async def _operator_in(self, tenant_id: str, method: str) -> Principal:
        """The operator within the tenant it named, which must exist."""
        if not tenant_id:
            raise PermissionDenied(
                f"the operator credential calls {method} only within a tenant it names: send "
                f'metadata "{TENANT_METADATA}: <tenant id>" (the CLI\'s --tenant)'
            )
        if not is_identifier(tenant_id, max_length=128):
            raise InvalidArgument(
                f"{TENANT_METADATA} must be 1-128 characters of letters, digits and . _ : @ -"
            )
        async with self._engine.connect() as conn:
            if not await tenant_exists(conn, tenant_id):
                raise NotFound(f"tenant {tenant_id!r} not found")
        return operator_in(tenant_id)

    def forget(self, key_id: str) -> None:
        """Drop a key from this replica's cache (it was just revoked here)."""
        for secret, (_, principal) in list(self._cache.items()):
            if principal.key_id == key_id:
                self._cache.pop(secret, None)

    def forget_tenant(self, tenant_id: str) -> None:
        """Drop every key of a tenant from this replica's cache (they were just revoked)."""
        for secret, (_, principal) in list(self._cache.items()):
            if principal.tenant_id == tenant_id:
                self._cache.pop(secret, None)

    def _is_operator(self, secret: str) -> bool:
        if self._operator is None or secret.startswith(KEY_PREFIX):
            return False
        return hmac.compare_digest(hashlib.sha256(secret.encode()).digest(), self._operator)

    def forget_secret(self, secret: str) -> None:
        """Drop one credential from this replica's cache (its session was just revoked here)."""
        self._cache.pop(secret, None)

    async def verify_key(self, api_key: str) -> Principal:
        """The principal of an API key (never a token or session); raises Unauthenticated."""
        if not api_key.startswith(KEY_PREFIX):
            raise Unauthenticated("an API key (tk_...) is required here")
        if not is_utf8(api_key):
            raise Unauthenticated("the API key is not valid (unknown, revoked or expired)")
        return await self._verify(api_key, session=False)

    async def verify_session(self, secret: str) -> Principal:
        """The principal of a session cookie's secret; raises Unauthenticated."""
        return await self._verify(secret, session=True)

    async def _verify(self, api_key: str, *, session: bool) -> Principal:
        now = time.monotonic()
        if api_key.startswith(SESSION_PREFIX) != session:
            raise Unauthenticated("the API key is not valid (unknown, revoked or expired)")
        cached = self._cache.get(api_key)
        if cached is not None and cached[0] > now:
            return cached[1]
        principal = None
        if len(api_key) < 200:
            principal = await self._find(api_key)
        if principal is None:
            what = {SESSION_PREFIX: "session", TOKEN_PREFIX: "token"}.get(api_key[:3], "API key")
            raise Unauthenticated(f"the {what} is not valid (unknown, revoked or expired)")
        if len(self._cache) > 10_000:
            self._cache.clear()
        trusted_for = self._ttl
        if principal.expires_at is not None:
            trusted_for = min(
                trusted_for, (principal.expires_at - datetime.now(UTC)).total_seconds()
            )
        self._cache[api_key] = (now + trusted_for, principal)
        return principal

    async def _find(self, secret: str) -> Principal | None:
        async with self._engine.connect() as conn:
            if secret.startswith(KEY_PREFIX):
                return await find_key(conn, secret)
            kind: browser_credentials.Kind
            if secret.startswith(TOKEN_PREFIX):
                kind = "token"
            elif secret.startswith(SESSION_PREFIX):
                kind = "session"
            else:
                return None
            found = await browser_credentials.find(conn, secret, kind)
        return None if found is None else found.principal


class KeyWatch:
    """Re-verifies the key an open stream was opened with, every `recheck_s` at most: the
    stream calls `verify_if_due()` whenever it wakes and bounds its waits with `bound()`, so a
    revoked or expired key ends it UNAUTHENTICATED within the cache TTL plus `recheck_s`."""

    def __init__(
        self, auth: Authenticator, metadata: Mapping[str, str | bytes], method: str
    ) -> None:
        self._auth = auth
        self._metadata = dict(metadata)
        self._method = method
        self._due = time.monotonic() + auth.recheck_s

    def bound(self, wait: float) -> float:
        """`wait`, shortened so the stream wakes for its next re-verification."""
        return max(min(wait, self._due - time.monotonic()), 0.01)

    async def verify_if_due(self) -> None:
        """Re-verify when the interval has passed; raises Unauthenticated (or PermissionDenied)
        once the key no longer holds."""
        now = time.monotonic()
        if now < self._due:
            return
        self._due = now + self._auth.recheck_s
        await self._auth.authenticate(self._metadata, self._method)
