"""Where a run's WAL goes: `wal_bytes_per_run` taken apart by relation and record kind.

One stage of the hot path's shape (two workers, its own fresh database on the embedded
PostgreSQL) warms up, takes a CHECKPOINT, then runs RUNS one-turn runs at saturation; the WAL
between the two positions is read back with the server's own `pg_waldump` and every record's
total length is summed by the relation it names (its first block reference) and its kind
(`Heap:UPDATE`, `Btree:INSERT_LEAF`, ...). Records naming no relation (commits, the running
transactions' snapshots) are summed under `-`.

It prints `wal_bytes_per_run_by_relation`: the per-run total as the server's WAL positions say
(the figure `hotpath` prints, on a stage without its statement log), with the largest
(relation, kind) pairs beside it in bytes and records per run. It is the map for issue 34's
`wal_bytes_per_run` goal: which record to take out next, and what a change took out.
"""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import asyncpg

from bench.common import bench_servers, emit
from bench.hotpath_stage import Stage, stage
from bench.model import model_server
from bench.runs import saturate
from tether.stack.postgres import binaries

RUNS = 600  # the hot path's counted phase: per-run figures steady to a few bytes
WARMUP_RUNS = 40  # connections, caches and the first pages of every table
POLL_S = 0.1
TOP = 25  # (relation, kind) pairs printed, largest first
_RECORD = re.compile(r"rmgr: (\w+)\s+len \(rec/tot\):\s*\d+/\s*(\d+).*?desc: (\S+)")
_RELATION = re.compile(r"rel \d+/\d+/(\d+)")


def by_relation(dump: str, relations: dict[str, str]) -> tuple[Counter[str], Counter[str]]:
    """Bytes and records of `pg_waldump`'s output, by "relation kind" (`relations` names each
    relfilenode; one it does not know keeps its number)."""
    sizes: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for line in dump.splitlines():
        record = _RECORD.search(line)
        if record is None:
            continue
        manager, total, kind = record.groups()
        named = _RELATION.search(line)
        relation = relations.get(named.group(1), named.group(1)) if named else "-"
        key = f"{relation} {manager}:{kind}"
        sizes[key] += int(total)
        counts[key] += 1
    return sizes, counts


def _waldump(wal: Path, start: str, end: str) -> str:
    """`pg_waldump`'s records from `start` to `end` in the WAL folder `wal` (the binary the
    embedded server runs from: the same version as the WAL it reads)."""
    command = [str(binaries() / "pg_waldump"), "--path", str(wal), "--start", start]
    return subprocess.run(
        [*command, "--end", end], capture_output=True, text=True, check=True
    ).stdout


async def _measured(current: Stage, wal: Path) -> tuple[int, float, Counter[str], Counter[str]]:
    """RUNS runs at saturation after a CHECKPOINT: how many completed, the WAL they wrote (by
    the server's positions), and its records' bytes and counts by relation and kind."""
    db = await asyncpg.connect(current.db_url)
    try:
        await db.execute("CHECKPOINT")
        start = await db.fetchval("SELECT pg_current_wal_insert_lsn()::text")
        result = await saturate(current.db_url, current.client, runs=RUNS, poll_s=POLL_S)
        end = await db.fetchval("SELECT pg_current_wal_insert_lsn()::text")
        # The WAL up to `end` on disk, for pg_waldump: a switch to the next segment flushes it,
        # and unlike a CHECKPOINT recycles none of the segments it reads.
        await db.execute("SELECT pg_switch_wal()")
        written = await db.fetchval(
            "SELECT pg_wal_lsn_diff($1::text::pg_lsn, $2::text::pg_lsn)::float8", end, start
        )
        relations = {
            str(node): name
            for node, name in await db.fetch(
                "SELECT relfilenode, relname FROM pg_class WHERE relfilenode <> 0"
            )
        }
    finally:
        await db.close()
    sizes, counts = by_relation(_waldump(wal, start, end), relations)
    return result.completed, float(written), sizes, counts


def _emit(
    figure: str, measured: tuple[int, float, Counter[str], Counter[str]], **config: Any
) -> None:
    completed, written, sizes, counts = measured
    runs = max(completed, 1)
    emit(
        figure,
        written / runs,
        "bytes/run",
        runs=completed,
        dumped_bytes_per_run=round(sum(sizes.values()) / runs, 1),
        largest={
            key: {"bytes": round(size / runs, 1), "records": round(counts[key] / runs, 2)}
            for key, size in sizes.most_common(TOP)
        },
        measured="WAL between two server positions around RUNS one-turn runs at saturation, "
        "after a CHECKPOINT; pg_waldump's records summed by relation and kind",
        **config,
    )


async def run() -> None:
    """Print wal_bytes_per_run_by_relation."""
    async with bench_servers(embedded=True) as servers, model_server() as model:
        assert servers.pg is not None, "embedded: pg_waldump reads the server's own WAL"
        wal = servers.pg.data_dir / "pg_wal"
        async with stage(servers, model) as current:
            await saturate(current.db_url, current.client, runs=WARMUP_RUNS, poll_s=POLL_S)
            _emit("wal_bytes_per_run_by_relation", await _measured(current, wal))
