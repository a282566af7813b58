"""Which tenants have a cap on runs running at once (tenants.max_running), as a replica's claims
need to know: read every `CAPS_TTL_S` in the background, so a claim costs no statement more.
While a replica does not know a tenant is capped yet, its claims lease none of that tenant's
runs (the claim reads the caps itself for that); from the next read on they lease them within
the cap.

A run queued while its tenant has a cap is flagged `capped` (by admission's statement): the
claim finds such runs by a probe per capped tenant, not in its fair scan. The caps change apart
from the runs (the gateway's `tether tenant set`), so each read keeps the flags in step: a
tenant newly capped has its queued runs flagged, one no longer capped cleared, and a flagged run
of an uncapped tenant (queued by an admission that read the cap just before it was removed) is
cleared at the next read. Any change wakes the replica's waiting claims. After each read the
replica's claims keep the runs held back by agents' caps reachable (`also`:
`held_agents.HeldAgents.settle`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from sqlalchemy.ext.asyncio import AsyncEngine

from services.orchestrator.repositories import fair

log = logging.getLogger(__name__)

CAPS_TTL_S = 1.0


class CapWatch:
    """The capped tenants, as last read."""

    def __init__(
        self,
        engine: AsyncEngine,
        ttl_s: float = CAPS_TTL_S,
        changed: Callable[[], None] = lambda: None,
        also: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        self._engine = engine
        self._also = also  # done after each read in the background (the agents' held runs)
        self._ttl_s = ttl_s
        self._changed = changed
        self.capped: frozenset[str] = frozenset()
        self._flagged: frozenset[str] | None = None  # the caps the flags were last set for

    async def read(self) -> frozenset[str]:
        """Read the capped tenants now, and bring their runs' flags in step."""
        async with self._engine.connect() as conn:
            capped = frozenset(await fair.capped_tenants(conn))
            flagged = frozenset(await fair.flagged_tenants(conn))
            before = self._flagged
            new = capped if before is None else capped - before
            # Those no longer capped, and any other with a flagged run (queued by an admission
            # that read its cap as it was being removed).
            cleared = (flagged - capped) | (frozenset() if before is None else before - capped)
            moved = await fair.flag_capped(conn, new, True)
            moved += await fair.flag_capped(conn, cleared, False)
            await conn.commit()
        self._flagged = capped
        if capped != self.capped or moved:
            self.capped = capped
            self._changed()
        return self.capped

    async def watch(self) -> None:
        """Read them every `ttl_s`, for as long as the replica runs."""
        while True:
            try:
                await self.read()
                if self._also is not None:
                    await self._also()
            except Exception:
                log.exception("reading the caps failed; trying again in %.1f s", self._ttl_s)
            await asyncio.sleep(self._ttl_s)
