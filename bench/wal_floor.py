"""The append-only floor of the WAL a run writes: the rows a run leaves behind, each written
once in its final state, into copies of the same tables with the same indexes, in two
transactions per run (its admission, then the rest). No row is updated, locked, upserted or
deleted, so what this writes is what the run's records and the indexes that serve their reads
cost on their own; `wal_bytes_per_run` less this is what the run's moves (claim, lease,
completion, hand-over) and the locks beside them add.

The rows are the counted phase's own, read back after it: the floor writes exactly what the
stack kept (the same texts, ids and payloads), so the two figures differ only in how the rows
got there.
"""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg

from bench.counters import pg_counters, wal_bytes

# Every table a one-turn run writes a row to, with how its rows for a set of runs are found
# ($1: the run ids). Admission writes the first five (a run's keys, `run_keys`, with the run: a
# trigger on `runs` writes them, which the copy of `runs` does not have, so the floor writes
# them itself; its run.queued is read from the run's row, 0048); the rest belongs to its
# execution.
_SOURCES: dict[str, str] = {
    "event_claims": "run_id = ANY($1)",
    "sessions": "session_id IN (SELECT session_id FROM runs WHERE run_id = ANY($1))",
    "messages": "message_id IN (SELECT message_id FROM runs WHERE run_id = ANY($1))",
    "runs": "run_id = ANY($1)",
    "run_keys": "run_id = ANY($1)",
    "run_events": "run_id = ANY($1)",
    "attempts": "run_id = ANY($1)",
    "run_parts": "run_id = ANY($1)",
    "usage_turns": "run_id = ANY($1)",
    "audit_log": "run_id = ANY($1)",
}
# What a copy keeps: the columns, their defaults and checks, and every index (partial ones
# included); not the foreign keys (the floor takes no locks) nor the identity sequences (the
# copied ids are written as they are).
_LIKE = "INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES INCLUDING STORAGE"


@dataclass(frozen=True)
class WalFloor:
    """WAL bytes of the append-only floor, the runs it wrote, and its rows per run by table."""

    bytes: int
    runs: int
    rows_per_run: dict[str, float]

    @property
    def per_run(self) -> float:
        return self.bytes / self.runs


async def append_only(
    admin: asyncpg.Connection, db_url: str, database: str, run_ids: list[str]
) -> WalFloor:
    """Write `run_ids`' rows again, append-only (see the module); its WAL, read like the
    phase's (the server's WAL position, right after a CHECKPOINT)."""
    conn = await asyncpg.connect(db_url)
    try:
        rows = {
            table: await conn.fetch(f"SELECT * FROM {table} WHERE {where}", run_ids)
            for table, where in _SOURCES.items()
        }
        for table in _SOURCES:
            await conn.execute(f"CREATE TABLE floor_{table} (LIKE {table} {_LIKE})")
        per_run = _by_run(rows)
        statements = {
            table: _insert(f"floor_{table}", list(found[0].keys()))
            for table, found in rows.items()
            if found
        }
        await admin.execute("CHECKPOINT")
        before = await pg_counters(admin, database)
        for run_id in run_ids:
            admission, execution = per_run[run_id]
            for part in (admission, execution):
                async with conn.transaction():
                    for table, record in part:
                        await conn.execute(statements[table], *record.values())
        after = await pg_counters(admin, database)
        return WalFloor(
            await wal_bytes(admin, before, after),
            len(run_ids),
            {table: round(len(found) / len(run_ids), 3) for table, found in rows.items()},
        )
    finally:
        await conn.close()


_Rows = list[tuple[str, asyncpg.Record]]


def _by_run(rows: dict[str, list[asyncpg.Record]]) -> dict[str, tuple[_Rows, _Rows]]:
    """Each run's rows: those its admission writes, then the rest, in a run's own order. Each
    run is its own conversation, as in the counted phase: its session and message are its own."""
    runs = {r["run_id"]: r for r in rows["runs"]}
    keys = {r["run_id"]: r for r in rows["run_keys"]}
    sessions = {r["session_id"]: r for r in rows["sessions"]}
    messages = {r["message_id"]: r for r in rows["messages"]}
    split: dict[str, tuple[_Rows, _Rows]] = {run_id: ([], []) for run_id in runs}
    for run_id, run in runs.items():
        admission = split[run_id][0]
        admission.append(("sessions", sessions[run["session_id"]]))
        admission.append(("messages", messages[run["message_id"]]))
        admission.append(("runs", run))
        admission.append(("run_keys", keys[run_id]))
    for claim in rows["event_claims"]:
        split[claim["run_id"]][0].insert(0, ("event_claims", claim))
    for record in sorted(rows["run_events"], key=lambda r: r["seq"]):
        split[record["run_id"]][1].append(("run_events", record))
    for table in ("attempts", "run_parts", "usage_turns", "audit_log"):
        for record in rows[table]:
            split[record["run_id"]][1].append((table, record))
    return split


def _insert(table: str, columns: list[str]) -> str:
    names = ", ".join(f'"{c}"' for c in columns)
    values = ", ".join(f"${i}" for i in range(1, len(columns) + 1))
    return f"INSERT INTO {table} ({names}) VALUES ({values})"
