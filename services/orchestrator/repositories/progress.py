"""Writes of an attempt's progress under its lease: checkpoints (parts, events, priced model
turns), whole tool outputs, and the effects record.

Every write here is fenced by LEASE_HELD (`transitions`): a worker whose lease was reaped writes
nothing, and the same statement extends the lease it holds.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    CTE,
    BigInteger,
    Integer,
    Interval,
    SmallInteger,
    Text,
    bindparam,
    cast,
    func,
    literal,
    literal_column,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.types import Boolean

from services.orchestrator.repositories.parts import rewriting
from services.orchestrator.repositories.transitions import (
    EVENT_COUNT,
    EVENT_TYPES,
    LEASE_EPOCH,
    LEASE_HELD,
    appended_events,
    numbered,
    stored_event_params,
)
from tether import formats
from tether.db.direct import Direct
from tether.db.schema import effects, run_parts, runs, tool_outputs, usage_turns
from tether.domain import Event, EventType, ModelTurn, Part, StoredEvent, content_json
from tether.pricing import TOKEN_FIELDS

# The arrays a batch's parts and model turns are bound as, by name (one element per part or
# turn): written by a checkpoint, and by the completion (`completion`).
BATCH_ARRAYS: list[tuple[str, Any]] = [
    ("p_index", ARRAY(Integer)),
    ("p_role", ARRAY(Text)),
    ("p_kind", ARRAY(Text)),
    ("p_payload", ARRAY(Text)),
    ("p_final", ARRAY(Boolean)),
    ("t_model", ARRAY(Text)),
    *[(f"t_{k}", ARRAY(BigInteger)) for k in (*TOKEN_FIELDS, "cost_micros")],
]
_ARRAYS = {name: bindparam(name, type_=type_) for name, type_ in BATCH_ARRAYS}
_BATCH = bindparam("batch", type_=BigInteger)
_LEASE_TTL = bindparam("lease_ttl", type_=Interval)
_RUN_ID = bindparam("r_run_id", type_=Text)


def batch_params(parts: Sequence[Part], turns: Sequence[ModelTurn]) -> dict[str, Any]:
    """The bound values of BATCH_ARRAYS: `parts` as stored, `turns` as priced."""
    return {
        "p_index": [p.index for p in parts],
        "p_role": [str(p.role) for p in parts],
        "p_kind": [str(p.kind) for p in parts],
        "p_payload": [json.dumps(content_json(p.content)) for p in parts],
        "p_final": [p.final for p in parts],
        "t_model": [t.model for t in turns],
        **{f"t_{k}": [getattr(t, k) for t in turns] for k in (*TOKEN_FIELDS, "cost_micros")},
    }


def _new_parts(run_id: Any, fence: CTE | None = None) -> Any:
    """The insert of the bound parts of run `run_id` (a part already at an index is rewritten),
    each belonging to the lease that writes it; only when `fence` matched, when given."""
    new = (
        func.unnest(*[_ARRAYS[k] for k in ("p_index", "p_role", "p_kind", "p_payload", "p_final")])
        .table_valued("index", "role", "kind", "payload", "final")
        .render_derived("p", with_types=False)
    )
    return rewriting(
        pg_insert(run_parts).from_select(
            ["run_id", "part_index", "role", "kind", "payload", "final", "lease_epoch", "format"],
            select(
                run_id,
                new.c.index,
                new.c.role,
                new.c.kind,
                cast(new.c.payload, JSONB),
                new.c.final,
                LEASE_EPOCH,  # a new part belongs to the attempt that wrote it
                literal(formats.CURRENT, SmallInteger),
            ).select_from(new if fence is None else fence.join(new, true())),
        )
    )


def _new_turns(run_id: Any, seq_before: Any, fence: CTE | None = None) -> Any:
    """The insert of the bound priced model turns of run `run_id`, each naming the seq of its
    usage.updated (`usage_turns.event_seq`): the k-th turn's is the k-th usage.updated among the
    bound events (EVENT_TYPES), which take the seqs after `seq_before`; only when `fence`
    matched, when given."""
    usage = (*TOKEN_FIELDS, "cost_micros")
    turn = (
        func.unnest(_ARRAYS["t_model"], *[_ARRAYS[f"t_{k}"] for k in usage])
        .table_valued("model", *usage, with_ordinality="k")
        .render_derived("t", with_types=False)
    )
    event = (
        func.unnest(EVENT_TYPES)
        .table_valued("type", with_ordinality="ord")
        .render_derived("e", with_types=False)
    )
    usage_events = (
        select(event.c.ord, func.row_number().over(order_by=event.c.ord).label("k"))
        .where(event.c.type == _USAGE_UPDATED)
        .subquery("u")
    )
    return usage_turns.insert().from_select(
        ["run_id", "model", *usage, "event_seq"],
        select(run_id, turn.c.model, *[turn.c[k] for k in usage], seq_before + usage_events.c.ord)
        .select_from(turn if fence is None else fence.join(turn, true()))
        .outerjoin(usage_events, usage_events.c.k == turn.c.k),
    )


_USAGE_UPDATED = literal_column(f"'{EventType.USAGE_UPDATED}'", Text)

# A batch's parts and turns, for a writer that holds the run under its lease already (the
# completion, after its fence): binds r_run_id, held_epoch, BATCH_ARRAYS, e_types (the events
# the turns' usage.updated are among) and seq_before (the seq before the first of them).
PARTS = _new_parts(_RUN_ID)
TURNS = _new_turns(_RUN_ID, bindparam("seq_before", type_=BigInteger))


def _checkpoint_statement() -> Any:
    """Fence, parts, events and priced turns as ONE statement (one round trip, atomic), built
    once: every step reads the fence, so a stale lease writes nothing at all."""
    fence = (
        update(runs)
        .where(
            runs.c.run_id == _RUN_ID,
            LEASE_HELD,
            # A numbered batch lands once: a resent one (its answer was lost) changes nothing.
            or_(_BATCH == 0, runs.c.checkpoint_batch < _BATCH),
        )
        .values(
            last_seq=runs.c.last_seq + EVENT_COUNT,
            lease_expires_at=func.now() + _LEASE_TTL,
            checkpoint_batch=func.greatest(runs.c.checkpoint_batch, _BATCH),
        )
        .returning(
            runs.c.run_id,
            runs.c.last_seq,
            runs.c.cancel_requested_at,
            runs.c.tenant_id,
            runs.c.owner_principal_id,
        )
        .cte("fence")
    )
    return select(
        fence.c.run_id,
        fence.c.last_seq,
        fence.c.cancel_requested_at,
        fence.c.tenant_id,
        fence.c.owner_principal_id,
    ).add_cte(
        _new_parts(fence.c.run_id, fence).cte("new_parts"),
        appended_events(fence),
        _new_turns(fence.c.run_id, fence.c.last_seq - EVENT_COUNT, fence).cte("new_turns"),
    )


CHECKPOINT = Direct(_checkpoint_statement())


@dataclass(frozen=True, slots=True)
class Checkpointed:
    """What a checkpoint's fence returns of its run: where it now ends (`last_seq`), whether a
    cancel was requested, and who may see its events (the tenant and owner)."""

    run_id: str
    last_seq: int
    cancel_requested_at: datetime | None
    tenant_id: str
    owner_principal_id: str | None


async def checkpoint(
    conn: AsyncConnection,
    run_id: str,
    epoch: int,
    ttl_s: float,
    parts: Sequence[Part],
    events: Sequence[Event],
    turns: Sequence[ModelTurn],
    *,
    batch: int = 0,
    stored_format: int = formats.CURRENT,
) -> tuple[Checkpointed, list[StoredEvent]] | None:
    """Write parts, events and priced turns under the lease and extend it: what the fence
    returned of the run and the events with their seqs (as given: whole). None when the
    lease is stale or batch `batch` (> 0) of this lease already landed: nothing was written.
    Its events are stored by reference where they may be, up to `stored_format`
    (`tether.formats`)."""
    params = checkpoint_params(
        run_id, epoch, ttl_s, parts, events, turns, batch=batch, stored_format=stored_format
    )
    return checkpointed(await CHECKPOINT.first(conn, params), events)


def checkpoint_params(
    run_id: str,
    epoch: int,
    ttl_s: float,
    parts: Sequence[Part],
    events: Sequence[Event],
    turns: Sequence[ModelTurn],
    *,
    batch: int = 0,
    stored_format: int = formats.CURRENT,
) -> dict[str, Any]:
    """The values `CHECKPOINT` binds (see `checkpoint`)."""
    return {
        "r_run_id": run_id,
        "held_epoch": epoch,
        "batch": batch,
        "lease_ttl": timedelta(seconds=ttl_s),
        **batch_params(parts, turns),
        **stored_event_params(events, parts, turns, stored_format),
    }


def checkpointed(
    row: Row[Any] | None, events: Sequence[Event]
) -> tuple[Checkpointed, list[StoredEvent]] | None:
    """What `CHECKPOINT`'s row says (`checkpoint`): None for no row (nothing was written)."""
    if row is None:
        return None
    fenced = Checkpointed(
        row.run_id, row.last_seq, row.cancel_requested_at, row.tenant_id, row.owner_principal_id
    )
    return fenced, numbered(row.last_seq, events)


_HOLD = (
    update(runs)
    .where(runs.c.run_id == bindparam("r_run_id"), LEASE_HELD)
    .values(lease_expires_at=func.now() + _LEASE_TTL)
    .returning(runs.c.lease_expires_at, runs.c.cancel_requested_at, runs.c.tenant_id)
)


@dataclass(frozen=True, slots=True)
class Held:
    """A live lease, extended: its new expiry, the run's cancel request and tenant."""

    lease_expires_at: datetime
    cancel_requested_at: datetime | None
    tenant_id: str


async def hold_lease(conn: AsyncConnection, run_id: str, epoch: int, ttl_s: float) -> Held | None:
    """Extend a live lease (its expiry, the cancel request, the tenant); None when stale. The
    row stays locked to the end of the transaction, so a write after it is fenced too."""
    params = {"r_run_id": run_id, "held_epoch": epoch, "lease_ttl": timedelta(seconds=ttl_s)}
    row = (await conn.execute(_HOLD, params)).first()
    return (
        None if row is None else Held(row.lease_expires_at, row.cancel_requested_at, row.tenant_id)
    )


# The sum of the run's priced turns, a column per field.
USAGE_TOTAL = select(
    *[func.coalesce(func.sum(usage_turns.c[k]), 0).label(k) for k in (*TOKEN_FIELDS, "cost_micros")]
).where(usage_turns.c.run_id == bindparam("run_id"))


async def usage_total(conn: AsyncConnection, run_id: str) -> dict[str, int]:
    """Sum of the run's priced turns, as a run's total is stored (`runs.usage`): its fields
    that are not 0 (every reader takes a field left out as 0, as protobuf's Usage does)."""
    row = (await conn.execute(USAGE_TOTAL, {"run_id": run_id})).one()
    return {k: int(v) for k, v in zip((*TOKEN_FIELDS, "cost_micros"), row, strict=True) if v}


async def store_tool_output(conn: AsyncConnection, run_id: str, ref: str, content: str) -> None:
    """Keep a tool's whole output when its inline copy was truncated."""
    await conn.execute(
        pg_insert(tool_outputs)
        .values(output_ref=ref, run_id=run_id, content=content)
        .on_conflict_do_nothing()
    )


async def begin_effect(
    conn: AsyncConnection, tenant_id: str, key: str, run_id: str, epoch: int, tool_name: str
) -> tuple[str, dict[str, Any] | None]:
    """Open the effects record: ("begun"|"in-progress"|"done", stored result)."""
    inserted = (
        await conn.execute(
            pg_insert(effects)
            .values(
                tenant_id=tenant_id,
                key=key,
                run_id=run_id,
                owner_epoch=epoch,
                tool_name=tool_name,
                state="in-progress",
            )
            .on_conflict_do_nothing()
            .returning(effects.c.key)
        )
    ).first()
    if inserted is not None:
        return "begun", None
    row = (
        await conn.execute(
            select(effects)
            .where(effects.c.tenant_id == tenant_id, effects.c.key == key)
            .with_for_update()
        )
    ).one()
    if row.state == "done":
        return "done", dict(row.result or {})
    # In progress under another lease: its holder lost that lease (one live epoch per run, and
    # a lineage's runs never overlap), so this holder takes it over and fires again with the
    # same key, which the external system deduplicates on.
    await conn.execute(
        update(effects)
        .where(effects.c.tenant_id == tenant_id, effects.c.key == key)
        .values(run_id=run_id, owner_epoch=epoch)
    )
    return "in-progress", None


async def finish_effect(
    conn: AsyncConnection, tenant_id: str, key: str, result: dict[str, Any]
) -> None:
    """Store an effect's result; later calls with the key replay it."""
    await conn.execute(
        update(effects)
        .where(effects.c.tenant_id == tenant_id, effects.c.key == key)
        .values(state="done", result=result, finished_at=func.now())
    )
