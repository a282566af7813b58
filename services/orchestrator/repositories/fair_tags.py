"""A queued run's start tag (start-time fair queueing, `runs.fair_key`), taken in the statement
that queues it (`intake.queued_run`): the later of its tenant's finish tag and the queue's
virtual time, the tenant's finish tag moving on by 1 / weight, striped over STRIPES rows per
tenant (`tenant_stripes`) so that a tenant's admissions at once do not wait for each other. A
statement whose tag fell through (RACED: one of a tenant's first runs admitted at once) is
retagged by one more (`retag`). The claim leases by these tags (`fair`)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

from sqlalchemy import (
    CTE,
    BigInteger,
    Double,
    Select,
    Text,
    and_,
    bindparam,
    case,
    cast,
    exists,
    func,
    literal,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from tether.db.schema import in_state, runs, tenant_queues, tenant_stripes, tenants
from tether.domain import Run
from tether.states import RunStatus

_FAIR_TENANT = bindparam("fq_tenant_id", type_=Text)
# A tenant's finish tag is striped over this many rows (tenant_stripes): its admissions take
# tags from different stripes at once, so as many admissions of one tenant as this go on
# without waiting for each other's commits.
STRIPES = 16


# The queue's virtual time: the least start tag of a claimable run not leased before, but for a
# capped tenant's (those wait for their room, not their turn) (one scan of ix_runs_fair, past
# the runs queued again: a run refused by the model rate limit, retried or resumed keeps its
# tag, but its turn was served, and a newcomer starting level with it would go ahead of every
# run not yet leased); a run an agent's cap holds back counts (ix_runs_held_tags), as it did
# while it sat in the fair scan: a quiet tenant's run queued beside a capped flood starts level
# with the flood's head and takes turns with it, not behind all of it. With none queued, the
# latest finish tag of any tenant (one probe of ix_tenant_stripes_tail), so that a tenant busy
# long ago starts level with the rest, not behind them.
def _least_tag(held: bool) -> Any:
    return (
        select(runs.c.fair_key)
        .where(
            in_state(runs.c.status, RunStatus.QUEUED),
            runs.c.session_head,
            ~runs.c.capped,
            runs.c.held_agent.is_not(None) if held else runs.c.held_agent.is_(None),
            runs.c.started_at.is_(None),
        )
        .order_by(runs.c.fair_key)
        .limit(1)
        .scalar_subquery()
    )


_VIRTUAL_TIME = func.coalesce(
    func.least(_least_tag(False), _least_tag(True)),
    select(func.max(tenant_stripes.c.tail)).scalar_subquery(),
    literal(0.0, Double),
)
# Whether the tenant has a cap on runs at once (tenants.max_running): its run is `capped`.
CAPPED = (
    select(tenants.c.tenant_id)
    .where(tenants.c.tenant_id == _FAIR_TENANT, tenants.c.max_running.is_not(None))
    .exists()
)
# The virtual time and the tenant's weight (tenants.weight, 1 when unset), read once.
_CLOCK = select(
    _VIRTUAL_TIME.label("vt"),
    cast(
        func.coalesce(
            select(tenants.c.weight).where(tenants.c.tenant_id == _FAIR_TENANT).scalar_subquery(),
            1,
        ),
        Double,
    ).label("w"),
).cte("fair_clock")


def _stride(clock: Any) -> Any:
    """One run's worth of a stripe's tags: STRIPES runs of the tenant, 1 / weight each."""
    return literal(float(STRIPES), Double) / clock.c.w


_STRIDE = _stride(_CLOCK)


def _offer(stripe: Any, clock: Any = _CLOCK) -> Any:
    """A stripe's next tag: its tail, or, when the virtual time has passed it, the first tag of
    the stripe's from the virtual time on (in the tenant's units u = vt * weight: the least
    u + d, 0 <= d < STRIPES, with u + d = the stripe's number modulo STRIPES). The stripes'
    first tags past the virtual time are the tenant's next STRIPES tags, the least within one
    run's tag of it."""
    u = clock.c.vt * clock.c.w
    behind = cast(stripe.c.stripe, Double) - u
    stripes = literal(float(STRIPES), Double)
    first = (u + behind - stripes * func.floor(behind / stripes)) / clock.c.w
    return func.greatest(stripe.c.tail, first)


# The stripes as this statement's snapshot has them (the same rows, not locked).
_AS_READ = tenant_stripes.alias("stripe_as_read")
# The run's start tag (start-time fair queueing), in this order:
# - the tenant's free stripe with the least next tag, locked without waiting (SKIP LOCKED: a
#   stripe another admission holds is left to it), the stripe's tail moving on by _STRIDE. A
#   stripe another admission took and committed after this statement's snapshot, and before
#   its lock, is passed over as a held one is: its lock re-reads the row as it is now, and its
#   tail no longer matches the snapshot's (`stripe_as_read`, whose row is not re-read). Taking
#   it would take a tag a round of stripes on while a lower one may be free; retagging the run
#   instead cost a statement more for one admission in six at eight at once (issue 34);
_PICK = (
    select(tenant_stripes.c.tenant_id, tenant_stripes.c.stripe)
    .select_from(
        tenant_stripes.join(
            _AS_READ,
            and_(
                _AS_READ.c.tenant_id == tenant_stripes.c.tenant_id,
                _AS_READ.c.stripe == tenant_stripes.c.stripe,
            ),
        ).join(_CLOCK, true())
    )
    .where(tenant_stripes.c.tenant_id == _FAIR_TENANT, tenant_stripes.c.tail == _AS_READ.c.tail)
    .order_by(_offer(tenant_stripes), tenant_stripes.c.stripe)
    .limit(1)
    .with_for_update(skip_locked=True, of=tenant_stripes)
    .cte("fair_pick")
)
# The clock read in scalar subqueries (in an upsert's SET and RETURNING).
_CLOCK_READ = SimpleNamespace(
    c=SimpleNamespace(
        vt=select(_CLOCK.c.vt).scalar_subquery(), w=select(_CLOCK.c.w).scalar_subquery()
    )
)


def _moved_on(source: Select[Any], name: str) -> CTE:
    """The stripe `source` selects (tenant_id, stripe, tail) moved on by one run: an upsert on
    the existing row (an UPDATE would take the admission's `tenant_id` parameter as a value
    to SET; `source`'s tail is not written), returning the run's start tag."""
    upsert = pg_insert(tenant_stripes).from_select(["tenant_id", "stripe", "tail"], source)
    return (
        upsert.on_conflict_do_update(
            index_elements=[tenant_stripes.c.tenant_id, tenant_stripes.c.stripe],
            set_={"tail": _offer(tenant_stripes, _CLOCK_READ) + _stride(_CLOCK_READ)},
        )
        .returning((tenant_stripes.c.tail - _stride(_CLOCK_READ)).label("start"))
        .cte(name)
    )


# The stripe the pick locked, as the snapshot read it: locked, it stays so until this commits.
_TAKEN = _moved_on(select(_PICK.c.tenant_id, _PICK.c.stripe, literal(0.0, Double)), "fair_taken")
# - when every stripe is held (more admissions of the tenant at once than STRIPES), the one
#   with the least next tag, waiting for it;
_LEAST = tenant_stripes.alias("least_stripe")
_WAITED = _moved_on(
    select(_LEAST.c.tenant_id, _LEAST.c.stripe, literal(0.0, Double))
    .select_from(_LEAST.join(_CLOCK, true()))
    .where(_LEAST.c.tenant_id == _FAIR_TENANT, ~exists(select(_PICK.c.stripe)))
    .order_by(_offer(_LEAST), _LEAST.c.stripe)
    .limit(1),
    "fair_waited",
)
# - the tenant's first run: its stripes are made, the first of them taken (and its row in
#   tenant_queues, which a claim locks when the tenant has a cap). Two first runs at once: the
#   later finds the stripes made by the other and starts at the virtual time.
_NO_STRIPES = ~exists(
    select(tenant_stripes.c.stripe).where(tenant_stripes.c.tenant_id == _FAIR_TENANT)
)
_UNITS = func.ceil(_CLOCK.c.vt * _CLOCK.c.w)
_NUMBERS = (
    func.generate_series(0, STRIPES - 1).table_valued("n").render_derived(name="stripe_numbers")
)
_MADE = (
    pg_insert(tenant_stripes)
    .from_select(
        ["tenant_id", "stripe", "tail"],
        select(
            tenants.c.tenant_id,
            _NUMBERS.c.n,
            case(
                (
                    _NUMBERS.c.n == func.mod(cast(_UNITS, BigInteger), STRIPES),
                    _UNITS / _CLOCK.c.w + _STRIDE,
                ),
                else_=literal(0.0, Double),
            ),
        )
        .select_from(tenants.join(_NUMBERS, true()).join(_CLOCK, true()))
        .where(tenants.c.tenant_id == _FAIR_TENANT, _NO_STRIPES),
    )
    .on_conflict_do_nothing()
    .returning(tenant_stripes.c.tail)
    .cte("fair_made")
)
QUEUE_ROW = (
    pg_insert(tenant_queues)
    .from_select(
        ["tenant_id"],
        select(tenants.c.tenant_id).where(tenants.c.tenant_id == _FAIR_TENANT, _NO_STRIPES),
    )
    .on_conflict_do_nothing()
    .returning(tenant_queues.c.tenant_id)
    .cte("fair_queue_row")
)
START = func.coalesce(
    select(_TAKEN.c.start).scalar_subquery(),
    select(_WAITED.c.start).scalar_subquery(),
    select(func.max(_MADE.c.tail - _STRIDE))
    .select_from(_MADE.join(_CLOCK, true()))
    .scalar_subquery(),
    select(_CLOCK.c.vt).scalar_subquery(),
)
# Whether the run's tag fell through to the virtual time: it was one of its tenant's first runs
# admitted at once, and another admission made the stripes, which this statement, having waited
# for that one to commit, could not see; or the stripe it picked moved before it locked it. The
# caller then has `retag` take it a tag (one more statement, for these runs only); left at the
# virtual time, a burst of a new tenant's first runs would all share one tag and go ahead of
# every other tenant's.
_TOOK = or_(exists(select(_TAKEN.c.start)), exists(select(_WAITED.c.start)))
RACED = and_(~_TOOK, ~exists(select(_MADE.c.tail))).label("fair_raced")
_RETAG = (
    update(runs)
    .where(runs.c.run_id == bindparam("rt_run_id"))
    .values(
        fair_key=func.coalesce(
            select(_TAKEN.c.start).scalar_subquery(),
            select(_WAITED.c.start).scalar_subquery(),
            select(_CLOCK.c.vt).scalar_subquery(),
        )
    )
    .returning(runs.c.fair_key)
)


async def retag(conn: AsyncConnection, run: Run) -> Run:
    """`run` (just queued, its statement RACED) with a start tag taken from its tenant's
    stripes, now that the admission that made them committed: a statement begun after that
    commit sees them, and takes a free stripe's tag, or waits for the least held one's."""
    found = await conn.execute(_RETAG, {"rt_run_id": run.run_id, "fq_tenant_id": run.tenant_id})
    return replace(run, fair_key=found.scalar_one())
