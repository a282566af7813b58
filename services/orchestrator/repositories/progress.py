"""Writes of an attempt's progress: parts, events, usage turns and effects records.

Every write here is fenced: it starts with an UPDATE of the run row guarded by the lease epoch
(which also reserves the event seq range), so a worker whose lease was reaped cannot write.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Integer, Interval, bindparam, func, select, text, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection

from tether.db.schema import effects, run_parts, runs, tool_outputs, usage_turns
from tether.db.transitions import Event
from tether.domain import camel
from tether.pricing import TOKEN_FIELDS
from tether.states import RunStatus


@dataclass(frozen=True)
class PartRow:
    """A part in its stored form."""

    index: int
    role: str
    kind: str
    payload: dict[str, Any]
    final: bool
    # A later attempt took its place (run_parts.superseded_at); set here alone, never by a write.
    superseded: bool = False


_FENCE = (
    update(runs)
    .where(
        runs.c.run_id == bindparam("r_id"),
        runs.c.status == RunStatus.RUNNING.value,
        runs.c.lease_epoch == bindparam("epoch"),
    )
    .values(
        last_seq=runs.c.last_seq + bindparam("n_events"),
        lease_expires_at=func.now() + bindparam("ttl", type_=Interval),
    )
    .returning(runs.c.last_seq, runs.c.cancel_requested_at, runs.c.tenant_id)
)


_CHECKPOINT = text(
    """
    WITH fence AS (
        UPDATE runs
        SET last_seq = last_seq + cardinality(CAST(:e_types AS text[])),
            lease_expires_at = now() + CAST(:ttl AS interval),
            checkpoint_batch = GREATEST(checkpoint_batch, CAST(:batch AS bigint))
        WHERE run_id = :run_id AND status = 'running' AND lease_epoch = :epoch
          AND (CAST(:batch AS bigint) = 0 OR checkpoint_batch < CAST(:batch AS bigint))
        RETURNING last_seq, cancel_requested_at, tenant_id
    ), new_parts AS (
        INSERT INTO run_parts (run_id, part_index, role, kind, payload, final, updated_at,
                               lease_epoch)
        SELECT :run_id, p.idx, p.role, p.kind, CAST(p.payload AS jsonb), p.final, now(), :epoch
        FROM fence, unnest(CAST(:p_idx AS int[]), CAST(:p_role AS text[]),
                           CAST(:p_kind AS text[]), CAST(:p_payload AS text[]),
                           CAST(:p_final AS bool[])) AS p(idx, role, kind, payload, final)
        ON CONFLICT (run_id, part_index) DO UPDATE
        SET role = EXCLUDED.role, kind = EXCLUDED.kind, payload = EXCLUDED.payload,
            final = EXCLUDED.final, updated_at = now()
    ), new_events AS (
        INSERT INTO run_events (run_id, seq, type, payload)
        SELECT :run_id, fence.last_seq - cardinality(CAST(:e_types AS text[])) + e.ord,
               e.type, CAST(e.payload AS jsonb)
        FROM fence, unnest(CAST(:e_types AS text[]), CAST(:e_payloads AS text[]))
             WITH ORDINALITY AS e(type, payload, ord)
    ), new_turns AS (
        INSERT INTO usage_turns (run_id, model, input_tokens, output_tokens,
                                 cache_creation_input_tokens, cache_read_input_tokens,
                                 cost_micros)
        SELECT :run_id, t.model, t.i, t.o, t.cc, t.cr, t.cost
        FROM fence, unnest(CAST(:t_model AS text[]), CAST(:t_in AS bigint[]),
                           CAST(:t_out AS bigint[]), CAST(:t_cc AS bigint[]),
                           CAST(:t_cr AS bigint[]), CAST(:t_cost AS bigint[]))
             AS t(model, i, o, cc, cr, cost)
    )
    SELECT last_seq, cancel_requested_at, tenant_id FROM fence
    """
)


async def checkpoint(
    conn: AsyncConnection,
    run_id: str,
    epoch: int,
    ttl_s: float,
    parts: Sequence[PartRow],
    events: Sequence[Event],
    turns: Sequence[dict[str, Any]],
    *,
    batch: int = 0,
) -> Row[Any] | None:
    """Fence, parts, events and priced turns in ONE statement (one round trip, atomic);
    None when the lease epoch is stale or batch `batch` (> 0) of this lease already landed,
    in which case nothing was written."""
    params = {
        "run_id": run_id,
        "epoch": epoch,
        "batch": batch,
        "ttl": timedelta(seconds=ttl_s),
        "p_idx": [p.index for p in parts],
        "p_role": [p.role for p in parts],
        "p_kind": [p.kind for p in parts],
        "p_payload": [json.dumps(p.payload) for p in parts],
        "p_final": [p.final for p in parts],
        "e_types": [e.type for e in events],
        "e_payloads": [json.dumps(dict(e.payload)) for e in events],
        "t_model": [t["model"] for t in turns],
        "t_in": [int(t.get("input_tokens", 0)) for t in turns],
        "t_out": [int(t.get("output_tokens", 0)) for t in turns],
        "t_cc": [int(t.get("cache_creation_input_tokens", 0)) for t in turns],
        "t_cr": [int(t.get("cache_read_input_tokens", 0)) for t in turns],
        "t_cost": [int(t["cost_micros"]) for t in turns],
    }
    return (await conn.execute(_CHECKPOINT, params)).first()


async def fence(
    conn: AsyncConnection, run_id: str, epoch: int, n_events: int, ttl_s: float
) -> Row[Any] | None:
    """Check the lease, reserve `n_events` seqs and extend the lease; None when stale."""
    params = {"r_id": run_id, "epoch": epoch, "n_events": n_events, "ttl": timedelta(seconds=ttl_s)}
    return (await conn.execute(_FENCE, params)).first()


_UPSERT_PART = pg_insert(run_parts).values(
    run_id=bindparam("run_id"),
    part_index=bindparam("part_index"),
    role=bindparam("role"),
    kind=bindparam("kind"),
    payload=bindparam("payload"),
    final=bindparam("final"),
    lease_epoch=bindparam("lease_epoch"),
)
# A rewritten part keeps the attempt that first wrote it, and its superseded mark.
_UPSERT_PART = _UPSERT_PART.on_conflict_do_update(
    index_elements=["run_id", "part_index"],
    set_={
        "role": _UPSERT_PART.excluded.role,
        "kind": _UPSERT_PART.excluded.kind,
        "payload": _UPSERT_PART.excluded.payload,
        "final": _UPSERT_PART.excluded.final,
        "updated_at": func.now(),
    },
)


async def upsert_parts(
    conn: AsyncConnection, run_id: str, epoch: int, parts: Sequence[PartRow]
) -> None:
    """Insert or replace parts by index (writes proportional to the new parts only); a new
    part belongs to lease `epoch`'s attempt."""
    if not parts:
        return
    await conn.execute(
        _UPSERT_PART,
        [
            {
                "run_id": run_id,
                "part_index": p.index,
                "role": p.role,
                "kind": p.kind,
                "payload": p.payload,
                "final": p.final,
                "lease_epoch": epoch,
            }
            for p in parts
        ],
    )


_SUPERSEDE = (
    update(run_parts)
    .where(
        run_parts.c.run_id == bindparam("s_run_id"),
        run_parts.c.part_index == func.any(bindparam("s_indexes", type_=ARRAY(Integer))),
        run_parts.c.superseded_at.is_(None),
    )
    .values(superseded_at=func.now())
)


async def supersede(conn: AsyncConnection, run_id: str, parts: Sequence[PartRow]) -> None:
    """Mark `parts` superseded (kept, flagged; a part already marked keeps its time)."""
    if parts:
        params = {"s_run_id": run_id, "s_indexes": [p.index for p in parts]}
        await conn.execute(_SUPERSEDE, params)


_USAGE_TOTAL = select(
    *[func.coalesce(func.sum(getattr(usage_turns.c, k)), 0) for k in TOKEN_FIELDS],
    func.coalesce(func.sum(usage_turns.c.cost_micros), 0),
).where(usage_turns.c.run_id == bindparam("run_id"))


async def usage_total(conn: AsyncConnection, run_id: str) -> dict[str, Any]:
    """Sum of the run's priced turns."""
    row = (await conn.execute(_USAGE_TOTAL, {"run_id": run_id})).one()
    total = {k: int(v) for k, v in zip(TOKEN_FIELDS, row[:-1], strict=True)}
    total["cost_micros"] = int(row[-1])
    return total


_LIST_PARTS = (
    select(run_parts)
    .where(run_parts.c.run_id == bindparam("run_id"))
    .order_by(run_parts.c.part_index)
)


_ATTEMPT_PARTS = (
    select(runs.c.attempt, run_parts)
    .select_from(runs.outerjoin(run_parts, run_parts.c.run_id == runs.c.run_id))
    .where(runs.c.run_id == bindparam("run_id"))
    .order_by(run_parts.c.part_index)
)


async def attempt_and_parts(conn: AsyncConnection, run_id: str) -> tuple[int, list[PartRow]]:
    """The run's current attempt number and its parts (see `list_parts`), in one round trip."""
    rows = (await conn.execute(_ATTEMPT_PARTS, {"run_id": run_id})).all()
    return rows[0].attempt, [_stored(r) for r in rows if r.part_index is not None]


async def list_parts(conn: AsyncConnection, run_id: str) -> list[PartRow]:
    """The run's parts in order, superseded ones included (flagged)."""
    rows = (await conn.execute(_LIST_PARTS, {"run_id": run_id})).all()
    return [_stored(r) for r in rows]


def _stored(row: Any) -> PartRow:
    return PartRow(
        row.part_index,
        row.role,
        row.kind,
        dict(row.payload),
        row.final,
        row.superseded_at is not None,
    )


_RECENT_RUNS = (
    select(runs.c.run_id, runs.c.input_text, runs.c.created_at)
    .where(
        runs.c.session_id == bindparam("session_id"),
        runs.c.status == RunStatus.COMPLETED.value,
        runs.c.created_at < bindparam("before"),
    )
    .order_by(runs.c.created_at.desc())
    .limit(bindparam("limit_runs"))
    .subquery()
)
_SESSION_HISTORY = (
    select(
        _RECENT_RUNS.c.run_id,
        _RECENT_RUNS.c.input_text,
        run_parts.c.part_index,
        run_parts.c.role,
        run_parts.c.kind,
        run_parts.c.payload,
        run_parts.c.final,
    )
    .select_from(
        _RECENT_RUNS.outerjoin(
            run_parts,
            (run_parts.c.run_id == _RECENT_RUNS.c.run_id) & run_parts.c.superseded_at.is_(None),
        )
    )
    .order_by(_RECENT_RUNS.c.created_at, _RECENT_RUNS.c.run_id, run_parts.c.part_index)
)


async def session_history(
    conn: AsyncConnection, session_id: str, before: datetime, *, limit_runs: int
) -> Sequence[Any]:
    """The last `limit_runs` completed runs of a session before `before`, oldest first, each
    with its transcript's parts (a run without any appears once with NULL part columns)."""
    params = {"session_id": session_id, "before": before, "limit_runs": limit_runs}
    return (await conn.execute(_SESSION_HISTORY, params)).all()


# Parts the model produced in a turn; any other part (a tool result, a pause marker) ends one.
_MODEL_OUTPUT = frozenset({"text", "thinking", "tool_call"})


def _whole_call(part: PartRow) -> bool:
    # `cut` is how parts stored before superseding marked a call that never arrived whole.
    return part.kind == "tool_call" and part.final and not part.payload.get("cut")


def dangling_tool_calls(parts: Sequence[PartRow]) -> list[PartRow]:
    """Whole tool calls without a result: left behind by a crash or a cancellation. A call cut
    mid-stream is not one: its input never arrived whole, so it never runs and never gets a
    result (it is superseded, see `superseded_on_close`)."""
    answered = {p.payload.get("toolCallId") for p in parts if p.kind == "tool_result"}
    return [
        p
        for p in parts
        if _whole_call(p) and not p.superseded and p.payload.get("toolCallId") not in answered
    ]


def superseded_on_close(parts: Sequence[PartRow], *, regenerated: bool) -> list[PartRow]:
    """The parts an ending attempt leaves superseded (kept for audit, out of every transcript
    read and of the model's history).

    Always the tool calls whose input never arrived whole: never run, never sent back. And when
    another attempt follows (`regenerated`: a retry, a reaped or a released lease), every part
    of the model turn the attempt did not see to its end, because the next attempt asks the
    model again and streams the turn anew. That turn is the model output after the run's last
    tool result or pause marker, and it counts as unfinished only while it holds no whole call:
    a whole call means the model's turn stands (its call is run, or closed as interrupted,
    and the model answers the result). A terminal end keeps its unfinished text: it is the last
    thing the model said and nothing will say it again."""
    live = [p for p in parts if not p.superseded]
    marked = {p.index: p for p in live if p.kind == "tool_call" and not _whole_call(p)}
    if regenerated:
        turn: list[PartRow] = []
        for part in reversed(live):
            if part.kind not in _MODEL_OUTPUT:
                break
            turn.append(part)
        if not any(_whole_call(p) for p in turn):
            marked.update((p.index, p) for p in turn)
    return [marked[i] for i in sorted(marked)]


@dataclass(frozen=True)
class Closing:
    """What settles an attempt that is over: new parts, parts superseded, and their events."""

    parts: list[PartRow]
    superseded: list[PartRow]
    events: list[Event]


def close_attempt(
    parts: Sequence[PartRow], attempt: int, *, regenerated: bool, interrupted: str | None
) -> Closing:
    """Settle attempt number `attempt`, which is over: its superseded parts (see
    `superseded_on_close`) each announced by part.superseded and, with an `interrupted`
    reason, an error result closing every dangling whole call (without one, the next attempt
    runs those calls)."""
    superseded = superseded_on_close(parts, regenerated=regenerated)
    events = [
        Event("part.superseded", {"partIndex": p.index, "attempt": attempt}) for p in superseded
    ]
    new_parts: list[PartRow] = []
    next_index = max((p.index for p in parts), default=-1) + 1
    for call in dangling_tool_calls(parts) if interrupted is not None else []:
        call_id = call.payload.get("toolCallId", "")
        payload = {"toolCallId": call_id, "content": f"interrupted: {interrupted}", "isError": True}
        part = PartRow(next_index, "tool", "tool_result", payload, True)
        next_index += 1
        new_parts.append(part)
        events.append(Event("part.added", {"part": part_json(part)}))
        events.append(
            Event(
                "tool.failed",
                {
                    "toolCallId": call_id,
                    "name": call.payload.get("name", ""),
                    "error": {
                        "code": "tool_interrupted",
                        "message": interrupted,
                        "retryable": True,
                    },
                },
            )
        )
    return Closing(new_parts, superseded, events)


async def write_closing(conn: AsyncConnection, run_id: str, epoch: int, closing: Closing) -> None:
    """Store what `close_attempt` settled, under the attempt's lease epoch."""
    await upsert_parts(conn, run_id, epoch, closing.parts)
    await supersede(conn, run_id, closing.superseded)


def part_json(part: PartRow) -> dict[str, Any]:
    """The JSON form of a Part message (as json_format writes it)."""
    data: dict[str, Any] = {"index": part.index, "role": part.role, camel(part.kind): part.payload}
    if part.final:
        data["final"] = True
    if part.superseded:
        data["superseded"] = True
    return data


async def close_dangling(conn: AsyncConnection, run: Row[Any], reason: str) -> None:
    """Settle a finished run's parts under its last lease (their events are not needed: the
    run is over)."""
    parts = await list_parts(conn, run.run_id)
    closing = close_attempt(parts, run.attempt, regenerated=False, interrupted=reason)
    await write_closing(conn, run.run_id, run.lease_epoch, closing)


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
