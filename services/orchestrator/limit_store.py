"""The model rate limits' shared state in PostgreSQL, written in batches off the grant's path.

A grant is arithmetic on the replica's memory (services/orchestrator/rate_limits.py). This
keeps what must outlive a replica and be seen by the others, in two small deployment-wide
tables (migration 0036; a bucket belongs to a provider credential, not to a tenant):

- `model_limit_levels`: each (credential, model)'s levels as the pool's, written at most every
  `sync_s` and only while they changed. A replica that starts resumes from them, refilled by
  the time since they were measured, instead of starting full: a restart right after the pool
  spent a bucket does not let it burst past the limit for a window.
- `model_limit_replicas`: each replica's connected workers and heartbeat, refreshed every
  round. A replica's share of every limit is its workers over the live replicas' workers
  (heartbeat within `replica_timeout_s`), so the shares sum to 1 as replicas and workers come
  and go; the operator's `TETHER_ORCHESTRATOR_MODEL_LIMIT_SHARE` overrides it.

Nothing here is in Redis. PostgreSQL unreachable: rounds fail and are retried, grants go on
from memory with the last share.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sqlalchemy import delete, func, literal_column, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncEngine

from services.orchestrator.rate_limits import ModelLimits
from tether.db.schema.orchestrator_tables import model_limit_levels, model_limit_replicas
from tether.ratelimits import KINDS

log = logging.getLogger(__name__)

# A replica with no worker connected keeps this share (it grants nothing meanwhile; a share is
# never 0): a worker that connects gives it its part at once (LimitStore.workers_changed).
IDLE_SHARE = 0.01


def proportional_share(mine: int, everyone: int, replicas: int) -> float:
    """This replica's share: its workers over every live replica's; with none anywhere, an
    equal part."""
    if everyone <= 0:
        return 1.0 / max(1, replicas)
    if mine <= 0:
        return IDLE_SHARE  # grants nothing, having no worker; a share is never 0
    return min(1.0, mine / everyone)


class LimitStore:
    """Writes this replica's buckets and heartbeat in batches; reads the others' workers."""

    def __init__(
        self,
        engine: AsyncEngine,
        limits: ModelLimits,
        replica_id: str,
        workers: Callable[[], int],
        *,
        replica_timeout_s: float,
        share_override: float | None = None,
    ) -> None:
        self._engine = engine
        self._limits = limits
        self._replica_id = replica_id
        self._workers = workers
        self._timeout_s = replica_timeout_s
        self._override = share_override
        self.rounds = 0
        self.level_writes = 0
        # The other live replicas' workers and count, as of the last round: a worker that
        # connects or leaves here changes this replica's share at once (workers_changed).
        self._others = 0
        self._replicas = 1
        limits.ready = False  # until the first round: see ModelLimits.ready
        if share_override is not None:
            limits.set_share(share_override)

    async def resume(self) -> int:
        """At start: the buckets resume from the stored levels. How many (credential, model)."""
        elapsed = func.extract("epoch", func.now() - model_limit_levels.c.measured_at)
        async with self._engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(
                        model_limit_levels.c.credential,
                        model_limit_levels.c.model,
                        *(model_limit_levels.c[k] for k in KINDS),
                        elapsed.label("elapsed_s"),
                    )
                )
            ).all()
        for row in rows:
            pool = {k: row._mapping[k] for k in KINDS}
            self._limits.resume(row.credential, row.model, pool, float(row.elapsed_s))
        if rows:
            log.info("model limits resumed from %d stored bucket levels", len(rows))
        return len(rows)

    async def round(self) -> None:
        """Heartbeat, share from the live replicas' workers, levels when they changed."""
        mine = self._workers()
        try:
            await self._round(mine)
        except BaseException:
            self._limits.dirty = True  # not written: the next round tries again
            raise

    async def _round(self, mine: int) -> bool:
        async with self._engine.begin() as conn:
            await conn.execute(
                insert(model_limit_replicas)
                .values(replica_id=self._replica_id, workers=mine, heartbeat_at=func.now())
                .on_conflict_do_update(
                    index_elements=["replica_id"],
                    set_={"workers": mine, "heartbeat_at": func.now()},
                )
            )
            live = (
                await conn.execute(
                    select(
                        func.coalesce(func.sum(model_limit_replicas.c.workers), 0),
                        func.count(),
                    ).where(
                        model_limit_replicas.c.heartbeat_at
                        > func.now() - literal_column(f"interval '{float(self._timeout_s)} s'")
                    )
                )
            ).one()
            # The sum counts this replica's row as just written.
            self._others = max(0, int(live[0]) - mine)
            self._replicas = max(1, int(live[1]))
            self._reshare(mine)
            wrote = self._limits.dirty
            if wrote:
                # A grant while this writes marks them changed again: the next round has it.
                self._limits.dirty = False
                rows = [
                    {
                        "credential": credential,
                        "model": model,
                        **pool,
                        "measured_at": func.now(),
                        "replica_id": self._replica_id,
                    }
                    for credential, model, pool in self._limits.levels()
                ]
                if rows:
                    statement = insert(model_limit_levels).values(rows)
                    await conn.execute(
                        statement.on_conflict_do_update(
                            index_elements=["credential", "model"],
                            set_={
                                **{k: statement.excluded[k] for k in KINDS},
                                "measured_at": statement.excluded.measured_at,
                                "replica_id": statement.excluded.replica_id,
                            },
                        )
                    )
                    self.level_writes += 1
        self.rounds += 1
        self._limits.ready = True
        return wrote

    def workers_changed(self) -> None:
        """A worker's stream began or ended here: the share follows now, from the others'
        workers as of the last round (no statement; the next round writes the count)."""
        self._reshare(self._workers())

    def _reshare(self, mine: int) -> None:
        if self._override is None:
            self._limits.set_share(proportional_share(mine, mine + self._others, self._replicas))

    async def leave(self) -> None:
        """At shutdown: the last levels, and this replica's workers no longer count (PostgreSQL
        unreachable: its heartbeat lapses instead)."""
        self._limits.dirty = True
        try:
            await self.round()
            async with self._engine.begin() as conn:
                await conn.execute(
                    delete(model_limit_replicas).where(
                        model_limit_replicas.c.replica_id == self._replica_id
                    )
                )
        except Exception:
            log.warning("model limit levels not written at shutdown", exc_info=True)
