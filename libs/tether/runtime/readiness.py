"""A service is ready for calls only once the database's schema is at the migrations its
release ships: until then it reports NOT_SERVING (but alive), so the migrations Job gates a
rollout and a new pod takes no traffic while the schema is still the previous release's."""

from __future__ import annotations

import asyncio
import logging

from sqlalchemy.ext.asyncio import AsyncEngine

from tether.db.migrate import SchemaState, applied_revisions, schema_state, shipped_revisions
from tether.errors import Unavailable

log = logging.getLogger(__name__)


async def await_schema(engine: AsyncEngine, *, poll_s: float) -> SchemaState:
    """Return once the schema is at this release's head or past it (a newer release migrated
    it), looking every `poll_s` seconds; says in the log what it waits for."""
    head, _ = shipped_revisions()
    said = None
    while True:
        try:
            applied = await applied_revisions(engine)
        except Unavailable as exc:
            reason = exc.message
        else:
            state = schema_state(applied)
            if state is not SchemaState.BEHIND:
                if state is SchemaState.AHEAD:
                    log.info("schema at %s, newer than this release (%s)", applied, head)
                return state
            reason = f"schema at {', '.join(applied) or 'nothing'}, this release needs {head}"
        if reason != said:
            log.warning("not ready: %s (waiting for the migrations)", reason)
            said = reason
        await asyncio.sleep(poll_s)
