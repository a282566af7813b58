"""Retention: how long a tenant's finished work is kept, and the walk every owning service's
sweep takes over its own rows.

A tenant's policy lives in its `tenants.policy` JSON, under `retention` (seconds; `null` keeps
forever); what it does not say takes the defaults below:

    {"retention": {"runs_s": 2592000, "tool_outputs_s": 604800,
                   "conversations_s": 7776000, "claims_s": 31536000}}

Each service removes what it owns: the orchestrator a terminal run with its events, parts,
attempts, usage, effects and interactions (`runs_s` after it finished) and whole tool outputs
(`tool_outputs_s`); admission the messages no run names any more and the sessions left empty
(`runs_s` after the message came), and the tombstones of expired claims (`claims_s` after the
event was claimed). A removed run's claim stays as the event's tombstone (tenant, scope, key,
request hash), so a late duplicate is answered as one and never runs again.

Never removed: a run that is not terminal, a run another run retried (removed after it), and
what a live conversation's next run reads as history (its latest completed runs, while the
conversation had a run within `conversations_s`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tether.db.schema import tenants
from tether.runtime.tasks import rounds
from tether.settings import RetainingSettings

log = logging.getLogger(__name__)

DAY_S = 86_400.0


def _kept(default_s: float, doc: str) -> Any:
    return field(default=default_s, metadata={"doc": doc})


@dataclass(frozen=True)
class RetentionPolicy:
    """How long a tenant's finished work is kept, in seconds (`math.inf`: forever)."""

    runs_s: float = _kept(
        30 * DAY_S,
        "A terminal run, with its events, parts, attempts, usage, effects, interactions and "
        "audit records, after it finished; a message and the session it leaves empty as long "
        "after the message came.",
    )
    tool_outputs_s: float = _kept(
        7 * DAY_S,
        "The whole output of a tool whose inline copy was cut, after its run finished (nothing "
        "reads it back once the run is over; the run keeps the inline copy).",
    )
    conversations_s: float = _kept(
        90 * DAY_S,
        "A conversation is live while it had a run this recently, or has one still to go: its "
        "latest completed runs (what its next run reads as history) are kept however old.",
    )
    claims_s: float = _kept(
        365 * DAY_S,
        "An event's claim, after it was claimed: while its run is kept the claim stays with "
        "it; after, as a tombstone (tenant, scope, key, request hash) that answers a late "
        "duplicate as one.",
    )

    @classmethod
    def of(cls, tenant_id: str, policy: Mapping[str, Any] | None) -> RetentionPolicy:
        """The policy a tenant's `policy` JSON sets (its `retention` object), defaults for
        what it leaves out. A value that is not a positive number of seconds (or null, for
        forever) is logged and the default kept: a typo must not remove anything early."""
        given = (policy or {}).get("retention") or {}
        if not isinstance(given, Mapping):
            log.warning("tenant %s: policy.retention is not an object; defaults apply", tenant_id)
            return cls()
        known = {f.name for f in fields(cls)}
        values: dict[str, float] = {}
        for name, value in given.items():
            if name not in known:
                log.warning("tenant %s: unknown retention setting %r ignored", tenant_id, name)
            elif value is None:
                values[name] = math.inf
            elif isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
                values[name] = float(value)
            else:
                log.warning(
                    "tenant %s: retention %s=%r is not a positive number of seconds; the "
                    "default applies",
                    tenant_id,
                    name,
                    value,
                )
        return cls(**values)


async def tenant_policies(conn: AsyncConnection) -> dict[str, RetentionPolicy]:
    """Every tenant's retention policy, by tenant id."""
    rows = (await conn.execute(select(tenants.c.tenant_id, tenants.c.policy))).all()
    return {row.tenant_id: RetentionPolicy.of(row.tenant_id, row.policy) for row in rows}


# Where a walk stopped in a tenant's rows: the key (time, id) of the last row it examined.
Key = tuple[datetime, str]
# Before every key: where a walk starts.
OLDEST: Key = (datetime(1, 1, 1, tzinfo=UTC), "")


def walk_params(tenant_id: str, keep_s: float, after: Key | None, batch: int) -> dict[str, Any]:
    """The bound values a step's statements take: `tenant_id`, `keep` (an interval),
    `after_at` and `after_id` (the key to continue after) and `batch`."""
    after_at, after_id = after or OLDEST
    return {
        "tenant_id": tenant_id,
        "keep": timedelta(seconds=keep_s),
        "after_at": after_at,
        "after_id": after_id,
        "batch": batch,
    }


@dataclass(frozen=True)
class Step:
    """What one bounded step of a walk did in one tenant's rows."""

    examined: int
    removed: int
    # Examined but kept (still needed, or locked by someone else): the walk comes back for
    # them on its next pass.
    kept: int
    # The key of the last row examined (None: none examined, or the walk has no order).
    last: Key | None
    # When the walk reached the end of what has expired: the seconds until the next row
    # expires (None: it cannot tell, e.g. rows another service makes: look again later).
    next_in: float | None = None


# One step of a walk: (tenant, its policy, the key to continue after, at most how many rows).
StepFn = Callable[[str, RetentionPolicy, Key | None, int], Awaitable[Step]]


@dataclass
class _Place:
    """Where a walk stands in one tenant's rows."""

    policy: RetentionPolicy
    after: Key | None = None
    due: float = 0.0
    # Set when a pass kept rows: when the walk starts again from the oldest.
    repass_at: float | None = None


class Walk:
    """Walks each tenant's expired rows oldest first, `batch` rows a step, and says when it is
    next due (`round`, for `tether.runtime.tasks.rounds`).

    Rows expire in the order the walk reads them (the key is the time the policy counts from,
    then the id), so a walk that reached the end of what has expired continues after it later,
    never re-reading what it removed. Rows it kept (still needed) are looked at again on the
    next pass, `repass_s` later, from the oldest. A tenant whose next expiry it cannot tell is
    looked at again `look_again_s` later. A round takes at most `steps` steps, so each round
    is bounded however many tenants are due; the rest are due at once."""

    def __init__(
        self,
        name: str,
        step: StepFn,
        *,
        batch: int,
        repass_s: float,
        look_again_s: float,
        steps: int = 32,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self._step = step
        self._batch = batch
        self._repass_s = repass_s
        self._look_again_s = look_again_s
        self._steps = steps
        self._clock = clock
        self._places: dict[str, _Place] = {}
        self.removed = 0  # in all, for logs and tests

    async def round(self, policies: Mapping[str, RetentionPolicy]) -> float | None:
        """Take the due steps; the seconds until the next one is due (None: none known)."""
        now = self._clock()
        for gone in set(self._places) - set(policies):
            del self._places[gone]
        steps = 0
        for tenant_id, policy in policies.items():
            place = self._places.get(tenant_id)
            if place is None or place.policy != policy:
                # New, or its policy changed: walk it from the oldest now.
                place = self._places[tenant_id] = _Place(policy, due=now)
            if place.due > now or steps >= self._steps:
                continue
            steps += 1
            if place.repass_at is not None and place.repass_at <= now:
                place.after, place.repass_at = None, None
            step = await self._step(tenant_id, policy, place.after, self._batch)
            self.removed += step.removed
            if step.removed:
                log.info("%s: removed %d of tenant %s", self.name, step.removed, tenant_id)
            place.after = step.last or place.after
            if step.kept and place.repass_at is None:
                place.repass_at = now + self._repass_s
            if step.examined >= self._batch:
                place.due = now  # more has expired: the next round continues
                continue
            wait_s = self._look_again_s if step.next_in is None else max(step.next_in, 0.0)
            place.due = min(now + wait_s, place.repass_at or math.inf)
        soonest = min((p.due for p in self._places.values()), default=math.inf)
        return None if math.isinf(soonest) else max(soonest - self._clock(), 0.0)


class Sweeps:
    """An owner's retention sweeps: a walk over each kind of its rows (`steps`, by name),
    each round under every tenant's policy as it stands then. Each replica of the owner may
    sweep: what one holds locked, another skips."""

    def __init__(
        self, engine: AsyncEngine, steps: Mapping[str, StepFn], settings: RetainingSettings
    ) -> None:
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._settings = settings
        self.walks = {
            name: Walk(
                f"retention of {name}",
                step,
                batch=settings.retention_batch,
                repass_s=settings.retention_repass_s,
                look_again_s=settings.retention_poll_s,
            )
            for name, step in steps.items()
        }

    async def round(self) -> float | None:
        """One round of every walk; the seconds until one is next due."""
        async with self._autocommit.connect() as conn:
            policies = await tenant_policies(conn)
        due = [await walk.round(policies) for walk in self.walks.values()]
        known = [d for d in due if d is not None]
        return min(known) if known else None

    async def run(self) -> None:
        """Sweep until cancelled, each round when next due (`tether.runtime.tasks.rounds`)."""
        await rounds(
            self.round,
            "retention",
            least_s=self._settings.retention_interval_s,
            most_s=self._settings.retention_poll_s,
        )
