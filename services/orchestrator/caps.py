"""Which tenants have a cap on runs running at once (tenants.max_running), as a replica's claims
need to know: read every `CAPS_TTL_S` in the background, so a claim costs no statement more.
While a replica does not know a tenant is capped yet, its claims lease none of that tenant's
runs (the claim reads the caps itself for that); from the next read on they lease them within
the cap."""

from __future__ import annotations

import asyncio
import logging

from sqlalchemy.ext.asyncio import AsyncEngine

from services.orchestrator.repositories import fair

log = logging.getLogger(__name__)

CAPS_TTL_S = 1.0


class CapWatch:
    """The capped tenants, as last read."""

    def __init__(self, engine: AsyncEngine, ttl_s: float = CAPS_TTL_S) -> None:
        self._engine = engine
        self._ttl_s = ttl_s
        self.capped: frozenset[str] = frozenset()

    async def read(self) -> frozenset[str]:
        """Read the capped tenants now."""
        async with self._engine.connect() as conn:
            self.capped = frozenset(await fair.capped_tenants(conn))
        return self.capped

    async def watch(self) -> None:
        """Read them every `ttl_s`, for as long as the replica runs."""
        while True:
            try:
                await self.read()
            except Exception:
                log.exception(
                    "reading the tenants' caps failed; trying again in %.1f s", self._ttl_s
                )
            await asyncio.sleep(self._ttl_s)
