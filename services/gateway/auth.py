"""Authenticates callers by API key and checks the scope each RPC needs."""

from __future__ import annotations

import time
from collections.abc import Mapping

from sqlalchemy.ext.asyncio import AsyncEngine

from tether.apikeys import KEY_PREFIX, Principal, find_key
from tether.errors import PermissionDenied, Unauthenticated

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
    "CreateApiKey": "admin",
}


class Authenticator:
    """Verifies keys against their stored hashes, caching verified keys briefly.

    The cache makes a hot key cost no database round trip; a revoked key stops working within
    `cache_ttl_s`.
    """

    def __init__(self, engine: AsyncEngine, *, cache_ttl_s: float = 10.0) -> None:
        self._engine = engine
        self._ttl = cache_ttl_s
        self._cache: dict[str, tuple[float, Principal]] = {}

    async def authenticate(self, metadata: Mapping[str, str | bytes], method: str) -> Principal:
        """The caller's principal, with the scope `method` needs; raises otherwise."""
        header = metadata.get("authorization", "")
        if not isinstance(header, str) or not header.startswith("Bearer "):
            raise Unauthenticated('missing API key: send metadata "authorization: Bearer <key>"')
        api_key = header.removeprefix("Bearer ").strip()
        principal = await self._verify(api_key)
        needed = SCOPES.get(method)
        if needed is None or needed not in principal.scopes:
            raise PermissionDenied(f"this API key lacks the scope {needed!r} that {method} needs")
        return principal

    async def _verify(self, api_key: str) -> Principal:
        now = time.monotonic()
        cached = self._cache.get(api_key)
        if cached is not None and cached[0] > now:
            return cached[1]
        principal = None
        if api_key.startswith(KEY_PREFIX) and len(api_key) < 200:
            async with self._engine.connect() as conn:
                principal = await find_key(conn, api_key)
        if principal is None:
            raise Unauthenticated("the API key is not valid")
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[api_key] = (now + self._ttl, principal)
        return principal
